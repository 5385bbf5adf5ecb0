"""VisualKV app entry point (also the Hugging Face Space entry): `python app.py`.

Flags: --model (offline alias, Hub id or local path; default: $VISUALKV_MODEL, else an offline model), --host, --port,
--share, --device, --public, --allow-model, --max-queue, --max-client-sessions, --turn-time-limit, --max-upload.
With no network the app starts on an offline model and says so on the page; if --model cannot be loaded, it starts
on the offline model and shows why.
"""

from __future__ import annotations

import argparse
import os

SHARED_CLIENT_SESSIONS = 2  # a visitor's sessions with a computation waiting or running, on a shared instance


def client_sessions(flag: int | None, public: bool) -> int | None:
    """`--max-client-sessions` as ServeOptions takes it: its default follows the mode, 0 means no bound."""
    if flag is None:
        return SHARED_CLIENT_SESSIONS if public else None
    return flag or None


def _parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    parser = argparse.ArgumentParser(description="VisualKV: chat with 4K images and long videos, see the KV cache")
    parser.add_argument(
        "--model",
        default=os.environ.get("VISUALKV_MODEL") or None,
        help="model to load at start (default: $VISUALKV_MODEL, else an offline model)",
    )
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1, or GRADIO_SERVER_NAME)")
    parser.add_argument("--port", type=int, default=None, help="port (default 7860, or GRADIO_SERVER_PORT)")
    parser.add_argument("--share", action="store_true", help="create a public Gradio link")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default=None,
        help="where the model runs (default: cuda when available)",
    )
    parser.add_argument(
        "--public",
        action="store_true",
        help="shared mode without --share (implied by --share and on a Hugging Face Space): only listed models load",
    )
    parser.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="ID",
        help="shared mode: also allow this model id (repeatable; or $VISUALKV_ALLOWED_MODELS=a,b)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests waiting at most; the next visitor is told the app is busy (default 16)",
    )
    parser.add_argument(
        "--max-client-sessions",
        type=int,
        default=None,
        metavar="N",
        help="sessions of one visitor (address) with a computation waiting or running at once "
        f"(default {SHARED_CLIENT_SESSIONS} on a shared instance, no bound locally; 0 = no bound)",
    )
    parser.add_argument(
        "--turn-time-limit",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a chat turn running longer is stopped like Stop (default 300; 0 = no limit)",
    )
    parser.add_argument(
        "--max-upload",
        default="200MB",
        metavar="SIZE",
        help="largest file a user may upload, e.g. 500MB or 4GB for an hour of video (default 200MB, fit for a Space)",
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.max_queue < 1 or args.turn_time_limit < 0 or (args.max_client_sessions or 0) < 0:
        parser.error("--max-queue must be >= 1, --turn-time-limit >= 0 and --max-client-sessions >= 0")
    from ui.size import parse_size

    try:
        max_upload = parse_size(args.max_upload)
    except ValueError as exc:
        parser.error(f"--max-upload: {exc}")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from visualkv.media import quiet_decoders

    quiet_decoders()  # users' broken videos are reported on the page; FFmpeg's lines would flood the log
    import torch

    from ui.app import build_app, launch
    from ui.sharing import ServeOptions
    from visualkv.errors import ModelLoadError
    from visualkv.models.registry import check_device
    from visualkv.runtime.access import is_public

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_device(device)  # --device cuda without a visible GPU: one line before anything starts
    except ModelLoadError as exc:
        parser.error(str(exc))
    public = is_public(share=args.share, public=args.public)
    serve = ServeOptions(
        public=public,
        allow_models=tuple(args.allow_model),
        max_queue=args.max_queue,
        turn_time_limit=args.turn_time_limit or None,
        max_upload_bytes=max_upload,
        max_client_sessions=client_sessions(args.max_client_sessions, public),
    )
    if serve.public:  # the library's "auto" settings (the chat's --park-cache) read shared mode from here
        os.environ.setdefault("VISUALKV_PUBLIC", "1")
    demo = build_app(default_model=args.model, device=device, serve=serve)
    mode = "shared mode: only listed models load" if serve.public else "local mode"
    print(f"VisualKV: model {demo.vkv_model} on {device} ({mode})", flush=True)
    launch(demo, host=args.host, port=args.port, share=args.share)


if __name__ == "__main__":
    main()
