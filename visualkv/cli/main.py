"""Command line: `python -m visualkv run|bench|eval|models ...`.

Bad input exits with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from visualkv.errors import VisualKVError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage otherwise)
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """`run`'s options, in the groups `--help` shows."""
    from visualkv.cli.args import HelpFormatter

    p.formatter_class = HelpFormatter
    _input_args(p.add_argument_group("what to read", "the model, the media and the questions"))
    _method_args(p.add_argument_group("compression", "the method, its budget and the block-wise prefill"))
    _video_args(p.add_argument_group("video", "which frames are read, and Sali-Cache's frame skipping"))
    _method_option_args(p.add_argument_group("method options", "each method's own settings (default: its own)"))
    _answer_args(p.add_argument_group("answers", "how answer tokens are chosen and run"))
    _device_args(p.add_argument_group("device", "where the model runs and the chat's state waits"))
    _output_args(p.add_argument_group("output", "what is written and printed"))


def _input_args(p: argparse._ArgumentGroup) -> None:
    from visualkv.cli.args import media_path
    from visualkv.models.registry import default_offline_model_name

    p.add_argument(
        "--model",
        default=default_offline_model_name(),
        help="offline alias, Hub id or local path (default: %(default)s, the bundled demo model when "
        "present; it answers questions about its synthetic scenes only)",
    )
    p.add_argument("--media", type=media_path, help="image or video file (leave it out to chat about text alone)")
    p.add_argument("--prompt", action="append", required=True, help="one turn; repeat for several turns")


def _method_args(p: argparse._ArgumentGroup) -> None:
    from visualkv.cli.args import fraction, positive_int
    from visualkv.methods import method_names

    p.add_argument(
        "--method",
        default="full",
        choices=method_names(),
        metavar="METHOD",
        help="compression method: " + ", ".join(method_names()) + " (stages joined with + compose)",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=positive_int, help="visual KV entries kept per layer and KV head (M)")
    budget.add_argument(
        "--keep",
        type=fraction,
        metavar="F",
        help="the budget as a share of the media's visual tokens, e.g. 0.1 keeps 10 %% (M = F × visual tokens, "
        "at least 1; the report's budget is the figure it became)",
    )
    p.add_argument("--block-size", type=positive_int, help="visual tokens per block (default: model's)")
    p.add_argument("--prefill", choices=["hybrid", "blockwise", "bulk"], help="default: the method's")
    p.add_argument(
        "--followup",
        choices=["reuse", "reprefill"],
        default="reuse",
        help="query-aware methods: reuse the compressed cache or rebuild it per question",
    )
    p.add_argument(
        "--vision-ahead",
        type=positive_int,
        default=1,
        metavar="N",
        help="blocks whose media go through the vision tower in one call (every family; the same embeddings: "
        "fewer tower launches, a larger transient)",
    )


def _video_args(p: argparse._ArgumentGroup) -> None:
    from visualkv.cli.args import non_negative_int, positive_float

    p.add_argument("--fps", type=positive_float, default=1.0, help="video frames sampled per second")
    p.add_argument(
        "--max-frames",
        type=non_negative_int,
        default=None,
        help="video frames sampled at most, uniformly over the video (default or 0: no cap of its own; the method's "
        "applies: none for block-wise methods up to the 3 h video limit, 512 for the others, refused beyond)",
    )
    p.add_argument(
        "--skip-frames",
        action="store_true",
        help="skip redundant video frames before encoding (Sali-Cache's temporal filter) on top of --method, "
        "e.g. --method blockwise-keydiff --skip-frames: blockwise-keydiff+salicache, every kept token at "
        "full precision unless --tiers is given",
    )


def _method_option_args(p: argparse._ArgumentGroup) -> None:
    """A flag for every method option that declares one (visualkv.methods.options), typed and helped by it."""
    from visualkv.cli.args import non_negative_int
    from visualkv.methods import option_flags

    for flag, (opt, methods) in option_flags().items():
        kind = {int: non_negative_int if (opt.low or 0) >= 0 else int, float: float}.get(opt.type, str)
        p.add_argument(
            flag,
            type=kind,
            default=None,
            metavar=opt.metavar,
            help=f"{', '.join(methods)}: {opt.help} (default {opt.default})",
        )


def _answer_args(p: argparse._ArgumentGroup) -> None:
    from visualkv.cli.args import positive_int

    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="answer length limit per turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="model seed (offline aliases) and sampling seed")
    p.add_argument(
        "--decode",
        choices=["auto", "eager", "static", "graph"],
        default="auto",
        help="how answer tokens run: auto (a CUDA graph per answer on one CUDA device, else eager), graph, "
        "static (the graph's fixed-shape step without a graph) or eager (plain steps)",
    )
    p.add_argument(
        "--decode-attention",
        choices=["auto", "model", "grouped"],
        default="auto",
        help="a graph/static step's attention over its window: auto (grouped on CUDA from 4096 entries, else "
        "model), model (the model's own SDPA/eager with a mask) or grouped (batched matmuls; the same answers up "
        "to rounding)",
    )
    p.add_argument(
        "--decode-read-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="sampled tokens read back to the host at a time while decoding (default: 8 on a GPU, 1 on the CPU); "
        "EOS, Stop and the streamed text are seen at each read, the answer is the same",
    )


def _device_args(p: argparse._ArgumentGroup) -> None:
    from visualkv.cli.args import DEVICES, DTYPES

    p.add_argument("--device", choices=DEVICES, default="cpu", help="auto: device_map=auto over the GPUs")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--park-cache",
        # visualkv.runtime.park.PARK_MODES, not imported: building the parser loads no torch
        choices=("auto", "always", "never"),
        default="auto",
        help="where the chat's state waits between turns: always (on the host, moved to the device for each turn), "
        "never (where the turn left it) or auto (always on ZeroGPU and in shared mode, else never)",
    )


def _output_args(p: argparse._ArgumentGroup) -> None:
    from visualkv.cli.args import output_file

    p.add_argument(
        "--json", dest="json_out", type=output_file, help="write the JSON report here (checked before the run)"
    )
    p.add_argument(
        "--evidence",
        action="store_true",
        help="after each turn, compute its evidence recall: the share of the uncompressed model's attention from "
        "the answer to the visual tokens that the compressed cache kept (a second, uncompressed pass)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the answers")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m visualkv", description="VisualKV: KV-cache compression for VLMs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_run_args(sub.add_parser("run", help="chat with an image or video (one --prompt per turn)"))
    sub.add_parser("models", help="list offline aliases and suggested Hub models")
    bench = sub.add_parser("bench", help="benchmarks: memory, latency, fidelity, salicache, needle, gpu, one, report")
    from visualkv.cli.bench import add_bench_args

    add_bench_args(bench)
    from visualkv.cli.eval import add_eval_args

    add_eval_args(sub.add_parser("eval", help="accuracy on Video-MME, MLVU, V*Bench, HR-Bench (docs/EVAL.md)"))
    return parser


def _method_options(args: argparse.Namespace) -> dict:
    """Method-specific flags as method options (for a composed method, {stage: options}); refused when
    given for a method without that stage. `--skip-frames` / `--tiers` stack Sali-Cache on the method
    (`args.method` becomes the composed name, see `visualkv.cli.stacking`).

    The method is built once here so that bad values fail before any loading.
    """
    from visualkv.cli.stacking import stacked_method
    from visualkv.methods import make_method, method_traits, option_flags

    stages = method_traits(args.method).stages
    if args.skip_frames or (args.tiers is not None and "salicache" not in stages):
        args.method, stacked = stacked_method(args.method, args.skip_frames, args.tiers, args.flow_threshold)
        args.tiers, args.flow_threshold = stacked.get("tiers"), stacked.get("flow_threshold")
    stages = method_traits(args.method).stages
    chosen: dict = {}
    for flag, (opt, methods) in option_flags().items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        takers = [m for m in methods if m in stages]
        if not takers:
            raise VisualKVError(f"{flag} applies to --method {' or '.join(methods)} (or a composition with it) only")
        for method in takers:
            chosen.setdefault(method, {})[opt.name] = value
    if len(stages) == 1:
        chosen = chosen.get(args.method, {})
    if chosen:
        make_method(args.method, **chosen)
    return chosen


def cmd_run(args: argparse.Namespace) -> int:
    from visualkv.media import FrameSampling, load_media
    from visualkv.models.registry import load_model, shape_placement
    from visualkv.report.clock import video_read
    from visualkv.report.telemetry import write_json
    from visualkv.runtime.frame_cap import media_limits
    from visualkv.runtime.memory_guard import out_of_memory_caught
    from visualkv.runtime.session import ChatSession, SessionConfig

    method_options = _method_options(args)  # may stack Sali-Cache on args.method (--skip-frames, --tiers)
    config = SessionConfig(
        method=args.method,
        budget=args.budget,
        keep=args.keep,
        block_size=args.block_size,
        prefill=args.prefill,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        followup=args.followup,
        method_options=method_options,
        decode=args.decode,
        decode_attention=args.decode_attention,
        vision_ahead=args.vision_ahead,
        decode_read_every=args.decode_read_every,
        evidence=args.evidence,
        park_cache=args.park_cache,
    )
    config.validate()
    for prompt in args.prompt:
        if not prompt.strip():
            raise VisualKVError("a --prompt is empty; give each turn a question")
    sampling = FrameSampling(fps=args.fps, max_frames=args.max_frames or None)
    # lazily decoded; the frame cap follows the method (refused, one line, before any frame is decoded)
    media = load_media(args.media, limits=media_limits(args.method), sampling=sampling) if args.media else None
    for warning in getattr(media, "warnings", None) or []:
        print(f"warning: {warning}", file=sys.stderr)
    placement = shape_placement(args.device, args.dtype) if args.model.startswith("shape-") else None
    if placement and placement[0] == "cpu" and not args.quiet:  # minutes of silence otherwise
        from visualkv.models.synthetic.shapes import check_fits

        check_fits(args.model, *placement)  # a refusal stays one line: checked before anything is printed
        print(f"building {args.model} on cpu: its random weights take minutes here (seconds on a GPU)", file=sys.stderr)
    started = time.perf_counter()
    adapter = load_model(args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    if not args.quiet:
        param = next(adapter.model.parameters())
        print(
            f"model {args.model} loaded in {time.perf_counter() - started:.1f} s: "
            f"{param.device.type}, {str(param.dtype).split('.')[-1]}",
            file=sys.stderr,
        )
    session = ChatSession(adapter, config)

    duration = getattr(media, "duration", None) if getattr(media, "kind", None) == "video" else None

    def on_block(event) -> None:
        if not args.quiet:
            read = video_read(event.media_seconds, duration)  # "" for an image, or before the first frame
            print(
                f"  block {event.index + 1}/{event.n_blocks} {event.kind:5s} +{event.tokens_in:5d} tok  "
                f"kv {event.kv_bytes / 2**20:8.2f} MiB  peak {event.peak_kv_bytes / 2**20:8.2f} MiB"
                + (f"  video {read}" if read else ""),
                file=sys.stderr,
            )

    for i, prompt in enumerate(args.prompt):
        if not args.quiet:
            print(f"[turn {i + 1}] {prompt}", file=sys.stderr)
        with out_of_memory_caught(session):  # an OOM is one line (exit 2), not a traceback
            for _ in session.stream(prompt, media if i == 0 else None, on_block=on_block):
                pass  # streamed pieces; the CLI prints whole answers
        print(session.turns[-1].answer)
        turn = session.turns[-1]
        if not args.quiet and turn.decode_mode:
            print(
                f"  ttft {turn.ttft_seconds:.2f} s, decode {turn.decode_tokens_per_second:.1f} tok/s "
                f"({', '.join(x for x in (turn.decode_mode, turn.decode_attention) if x)})",
                file=sys.stderr,
            )
        if not args.quiet and turn.evidence_recall is not None:
            print(f"  evidence recall {turn.evidence_recall:.3f}", file=sys.stderr)
        elif not args.quiet and turn.evidence_note:
            print(f"  {turn.evidence_note}", file=sys.stderr)
    report = session.report()
    if not args.quiet:
        recall = report["evidence_recall"]
        print(
            f"visual tokens {report['visual_tokens']}, peak KV {report['peak_kv_bytes'] / 2**20:.2f} MiB, "
            f"final KV {report['final_kv_bytes'] / 2**20:.2f} MiB, full KV {report['full_kv_bytes'] / 2**20:.2f} MiB"
            + (f", evidence recall {recall:.3f}" if recall is not None else ""),
            file=sys.stderr,
        )
    if args.json_out:
        write_json(report, args.json_out)
    return 0


def cmd_models() -> int:
    from visualkv.models.registry import HUB_MODELS, OFFLINE_MODELS

    for choice in OFFLINE_MODELS + HUB_MODELS:
        print(f"{choice.name:45s} {'offline' if choice.offline else 'hub':8s} {choice.note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option already reported on one line
        return int(exc.code or 0)
    from visualkv.media import quiet_decoders

    quiet_decoders()  # a broken video's FFmpeg lines would print around the one-line error
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "models":
            return cmd_models()
        args.command_argv = list(sys.argv[1:] if argv is None else argv)  # recorded in every bench JSON
        if args.command == "eval":
            from visualkv.cli.eval import cmd_eval

            return cmd_eval(args)
        from visualkv.cli.bench import run_bench

        return run_bench(args)
    except VisualKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("VISUALKV_DEBUG"):
            raise
        line = (str(exc).strip().splitlines() or [""])[0][:300]
        print(
            f"error: unexpected failure ({type(exc).__name__}: {line}); rerun with VISUALKV_DEBUG=1 for details",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
