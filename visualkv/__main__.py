"""`python -m visualkv`: the command line (visualkv.cli.main)."""

from visualkv.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
