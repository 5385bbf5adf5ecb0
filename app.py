"""VisualKV app entry point (also the Hugging Face Space entry): `python app.py`.

Flags: --model (offline alias, Hub id or local path; default: $VISUALKV_MODEL, else an offline model), --host, --port,
--share, --device. With no network the app starts on an offline model and says so on the page;
if --model cannot be loaded, it starts on the offline model and shows why.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description="VisualKV: chat with 4K images and long videos, see the KV cache")
    parser.add_argument("--model", default=os.environ.get("VISUALKV_MODEL") or None,
                        help="model to load at start (default: $VISUALKV_MODEL, else an offline model)")
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1, or GRADIO_SERVER_NAME)")
    parser.add_argument("--port", type=int, default=None, help="port (default 7860, or GRADIO_SERVER_PORT)")
    parser.add_argument("--share", action="store_true", help="create a public Gradio link")
    parser.add_argument("--device", default=None, help="cpu, cuda or auto (default: cuda when available)")
    args = parser.parse_args()
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from ui.app import build_app, launch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    demo = build_app(default_model=args.model, device=device)
    print(f"VisualKV: model {demo.vkv_model} on {device}", flush=True)
    launch(demo, host=args.host, port=args.port, share=args.share)


if __name__ == "__main__":
    main()
