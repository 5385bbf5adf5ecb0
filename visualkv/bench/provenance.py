"""Where a benchmark figure came from: the command, the machine, how loaded it was, the code version.

Every benchmark JSON carries a ``provenance`` block written by :func:`save_json`, so a figure in
README.md or docs/ can always be traced to the run that produced it (``python -m visualkv bench
report`` prints the command and the machine beside each generated table).

Load: the 1-minute load average is read when the run starts and when it ends. A run is ``idle``
when both stay at or below the number of cores plus 0.5 (the benchmark itself keeps about one core
busy; more runnable processes than cores means something else competed for them), ``loaded``
otherwise. Wall-clock ratios from a loaded run are noisier; memory figures are exact either way.

Code: the full commit sha, whether the tree differed from it (`dirty`) and the sha256 of that difference
(:func:`git_state`), so a figure from uncommitted code can be told apart and matched to its diff.
``python -m visualkv.bench.provenance PATH [LABEL]`` writes the provenance of a run that starts and ends now
(scripts/gpu_check.sh puts one beside its logs).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from typing import Any


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


#: result files are data, not the code measured: a run of several benchmarks rewrites them as it goes
_NOT_CODE = ("--", ":/", ":(top,exclude)docs/results")


def git_output(folder: str, *args: str) -> str | None:
    """The output of `git ARGS` run in `folder`; None when git is missing, fails or exits non-zero."""
    try:
        out = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(folder: str | None = None) -> dict[str, Any]:
    """The code measured: `commit_sha` (HEAD, in full), `dirty` (tracked files outside docs/results differ from
    it: a GPU run measures the working tree it was sent, committed or not), `diff_sha256` (sha256 of `git diff
    HEAD` of those files, None when clean) and `commit` (HEAD's short sha, with "+changes" when dirty). All None
    outside a git checkout."""
    here = folder or os.path.dirname(os.path.abspath(__file__))
    sha = (git_output(here, "rev-parse", "HEAD") or "").strip()
    if not sha:
        return {"commit": None, "commit_sha": None, "dirty": None, "diff_sha256": None}
    diff = git_output(here, "diff", "HEAD", "--no-ext-diff", "--binary", *_NOT_CODE) or ""
    dirty = bool(diff)
    return {
        "commit": sha[:7] + ("+changes" if dirty else ""),
        "commit_sha": sha,
        "dirty": dirty,
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if dirty else None,
    }


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def start(argv: list[str] | None = None) -> dict[str, Any]:
    """Provenance of a run that starts now; `argv` defaults to this process's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": "python -m visualkv " + " ".join(args),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "load_start": _loadavg(),
        **git_state(),
        "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def finish(prov: dict[str, Any]) -> dict[str, Any]:
    """Add the end-of-run reading and the idle/loaded verdict (see the module docstring)."""
    out = dict(prov)
    out["load_end"] = _loadavg()
    out["gpu"] = _gpu_name()
    loads = [v for v in (out.get("load_start"), out["load_end"]) if v is not None]
    cores = out.get("cpu_cores") or 1
    out["condition"] = "unknown" if not loads else ("idle" if max(loads) <= cores + 0.5 else "loaded")
    return out


def machine_label(prov: dict[str, Any] | None) -> str:
    """One phrase for a table caption, e.g. '2 CPU cores, idle' or 'NVIDIA H200, loaded'."""
    if not prov:
        return "machine not recorded"
    where = prov.get("gpu") or f"{prov.get('cpu_cores', '?')} CPU cores"
    label = f"{where}, {prov.get('condition', 'unknown')}"
    return label + (" (recorded afterwards)" if prov.get("recorded") else "")


def save_json(out: dict[str, Any], path: str, prov: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a benchmark result with its provenance (finished now); returns what was written."""
    result = dict(out)
    result["provenance"] = finish(prov if prov is not None else start())
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m visualkv.bench.provenance PATH [LABEL]`: write this checkout's provenance, labelled, to PATH."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m visualkv.bench.provenance PATH [LABEL]", file=sys.stderr)
        return 2
    prov = start([])
    prov["command"] = " ".join(args[1:]) or prov["command"]
    save_json({}, args[0], prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
