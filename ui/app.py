"""The VisualKV page: layout and wiring only (callbacks in ui/handlers.py, drawing in visualkv/report/viz.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gradio as gr
from PIL import Image

from visualkv.bench.demo_examples import DemoExample, load_demo_examples, question_forms
from visualkv.models.registry import HUB_MODELS, OFFLINE_MODELS, offline_aliases
from visualkv.runtime.access import ModelPolicy, scrub_paths
from visualkv.runtime.streaming import method_settings

from . import text
from .handlers import (
    COMPARE_STOPPING,
    PREFILL_LABEL,
    READING_LABEL,
    STARTING_LABEL,
    STOPPING_LABEL,
    WAITING_LABEL,
    Handlers,
    stopping_html,
)
from .sharing import ServeOptions, limit_heap_arenas, release_on_close, release_state
from .state import ModelCache, default_offline_model, is_offline_model

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# generic examples: real-looking media for memory and kept-token maps (random-weight or Hub models)
GENERIC_EXAMPLES = [
    ("Where is the small red star?", ASSETS / "example_4k.png"),
    ("What happens in this video?", ASSETS / "example_video.mp4"),
]
DEFAULT_METHOD = "blockwise-snapkv"
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".avi", ".mkv")

CSS = """
#vkv-error {color: #b00020; font-weight: 600;}
#vkv-error:empty {display: none;}
#vkv-progress .vkv-bar {width: 100%; height: 14px;}
#vkv-summary {font-weight: 600;}
.vkv-small {font-size: 0.9em; opacity: 0.85;}
/* example cards: a thumbnail with the whole question under it (Gradio would cut the caption to one line) */
#vkv-examples .caption-label {white-space: normal !important; overflow: visible !important; max-width: 100% !important;
  text-overflow: clip !important; position: static !important; font-size: 0.8em; line-height: 1.2;}
#vkv-examples .thumbnail-item {flex-direction: column; aspect-ratio: auto !important; height: auto !important;}
#vkv-examples .thumbnail-item img {height: 80px !important; object-fit: cover;}
#vkv-examples .grid-wrap {min-height: 0 !important; height: auto !important; max-height: none !important;}
#vkv-examples .grid-container {padding-top: 32px !important;}  /* below the gallery's floating label */
#vkv-results button[role=tab] {padding: 4px 9px; font-size: 0.92em;}  /* all six result tabs fit in one row */
/* a control the chosen method does not use looks switched off, not editable */
#vkv-budget input:disabled {background: repeating-linear-gradient(45deg, #eee, #eee 6px, #e2e2e2 6px, #e2e2e2 12px);
  color: #888; cursor: not-allowed;}
"""


def chat_examples(demo: list[DemoExample]) -> list[dict]:
    """The chat box's examples: featured questions on the demo scenes, then the generic media."""
    pairs = [(q.question, e.path) for e in demo for q in e.featured()] + GENERIC_EXAMPLES
    return [{"text": question, "files": [str(path)]} for question, path in pairs]


def example_labels(examples: list[dict]) -> list[str]:
    """One label per example card: what the media is (4K image, video, its size) and the question."""
    return [f"{text.media_label(e['files'][0])}: {e['text']}" for e in examples]


THUMB_SIZE = (320, 180)


def example_thumbnail(path: str | Path) -> Image.Image:
    """A small picture of an example file for its card: the image itself, downscaled; for a video its
    poster frame (<name>.poster.png, written by scripts/make_examples.py), else its first frame."""
    path = Path(path)
    poster = path.with_suffix(".poster.png")
    if path.suffix.lower() in VIDEO_SUFFIXES:
        if poster.is_file():
            img = Image.open(poster).convert("RGB")
        else:  # no poster (media added by hand): the first frame
            import cv2

            cap = cv2.VideoCapture(str(path))
            ok, bgr = cap.read()
            cap.release()
            img = Image.fromarray(bgr[..., ::-1]) if ok else Image.new("RGB", THUMB_SIZE, (200, 200, 200))
    else:
        img = Image.open(path).convert("RGB")
    img.thumbnail(THUMB_SIZE)
    return img


def example_cards(examples: list[dict]) -> list[tuple[Image.Image, str]]:
    """The example cards: a thumbnail (a video's poster frame) and what the file is with the question."""
    thumbs: dict[str, Image.Image] = {}  # a file with several questions is read once
    cards = []
    for example, label in zip(examples, example_labels(examples)):
        path = example["files"][0]
        if path not in thumbs:
            thumbs[path] = example_thumbnail(path)
        cards.append((thumbs[path], label))
    return cards


def method_choices() -> list[str]:
    """The methods offered in the dropdowns (see `text.method_choices`, the one place the list comes from)."""
    return text.method_choices()


def model_choices(current: str) -> list[str]:
    names = list(dict.fromkeys([*(c.name for c in OFFLINE_MODELS), *offline_aliases(), *(c.name for c in HUB_MODELS)]))
    return names if current in names else [current, *names]


def start_model(cache: ModelCache, requested: str | None) -> tuple[str, str | None]:
    """Load the start model: `requested` if given and loadable, else an offline model (and why)."""
    if requested:
        try:
            cache.get(requested)
            return requested, None
        except Exception as exc:  # noqa: BLE001 - start on an offline model instead, and say so
            return default_offline_model(cache), str(exc)
    return default_offline_model(cache), None


def build_app(default_model: str | None = None, device: str = "cpu", serve: ServeOptions | None = None) -> gr.Blocks:
    """The whole app. Loads the start model now (an offline one when none is given or it fails).

    Layout (one screen at 1440x900): settings on the left; the chat with its progress and one-line
    summary in the middle; the results on the right (kept tokens before/after first, then the other
    views in tabs, the memory chart under them). Examples sit under the chat input.
    serve: shared-mode policy, queue size and turn time limit (default: local use, no model restriction).
    """
    serve = serve or ServeOptions()
    # the operator's own start model is allowed even when it is a local folder
    policy = ModelPolicy.create(serve.public, extra=[*serve.allow_models, *([default_model] if default_model else [])])
    cache = ModelCache(device=device, policy=policy)
    model_name, start_error = start_model(cache, default_model)
    if start_error and serve.public:
        start_error = scrub_paths(start_error)
    h = Handlers(cache, model_name)
    h.turn_time_limit = serve.turn_time_limit
    h.max_file_bytes = serve.max_upload_bytes
    method_names = method_choices()
    demo_examples = load_demo_examples()
    default_method = DEFAULT_METHOD if DEFAULT_METHOD in method_names else method_names[0]

    # delete_cache: uploads and served copies older than 6 h are removed every hour
    with gr.Blocks(title="VisualKV", analytics_enabled=False, delete_cache=(3600, 6 * 3600)) as demo:
        state = gr.State(None, time_to_live=4 * 3600, delete_callback=release_state)
        release_on_close(demo, state)  # a closed tab's cache is freed at once
        limit_heap_arenas()  # ... and its memory goes back to the OS, not into one of many thread arenas
        gr.Markdown(text.INTRO)
        model_note = gr.Markdown(
            text.offline_note(model_name, is_offline_model(model_name), start_error),
            elem_id="vkv-model-note",
            elem_classes="vkv-small",
        )
        with gr.Row(equal_height=False):
            # ---- settings ---------------------------------------------------------------------
            with gr.Column(scale=2, min_width=250, elem_id="vkv-settings"):
                with gr.Accordion("Model", open=True):
                    model_dd = gr.Dropdown(
                        model_choices(model_name),
                        value=model_name,
                        label="model",
                        info="offline aliases first; Hub models need network",
                        elem_id="vkv-model",
                    )
                    model_id = gr.Textbox(
                        label="…or a Hub id / local folder", placeholder="org/name or /path", elem_id="vkv-model-id"
                    )
                    load_btn = gr.Button("Load model", elem_id="vkv-load")
                method_dd = gr.Dropdown(method_names, value=default_method, label="method", elem_id="vkv-method")
                method_md = gr.Markdown(
                    text.method_line(default_method), elem_id="vkv-method-help", elem_classes="vkv-small"
                )
                # no minimum/maximum on number fields: Gradio would reject a bad value with an error badge
                # over the outputs; the handlers check every value and say what is wrong in one line
                budget = gr.Number(
                    1024,
                    precision=0,
                    label="budget M",
                    info=text.budget_info(default_method),
                    elem_id="vkv-budget",
                    interactive=text.traits(default_method).needs_budget,
                )
                block_size = gr.Number(
                    0,
                    precision=0,
                    label="block size",
                    info="visual tokens per prefill block; 0 = auto (the model's default)",
                    elem_id="vkv-block-size",
                )
                method_inputs, groups = [], {}
                for name in method_names:
                    settings = method_settings(name)
                    if not settings:
                        continue
                    with gr.Accordion(f"{name} settings", open=False, visible=name == default_method) as group:
                        gr.Markdown(text.traits(name).description or name, elem_classes="vkv-small")
                        for s in settings:
                            method_inputs.append((name, s.key, _setting_component(s)))
                    groups[name] = group
                with gr.Accordion("Generation and follow-ups", open=False):
                    max_new = gr.Number(
                        64, precision=0, label="max new tokens", info="1 to 4096", elem_id="vkv-max-new"
                    )
                    temperature = gr.Number(
                        0.0, label="temperature", info="0 = greedy; up to 5", elem_id="vkv-temperature"
                    )
                    followup = gr.Radio(
                        ["reuse", "reprefill"],
                        value="reuse",
                        label="follow-up turns",
                        info="reuse the compressed cache, or rebuild it per question (query-aware methods only)",
                    )
                    prefill = gr.Dropdown(
                        ["auto", "hybrid", "blockwise", "bulk"],
                        value="auto",
                        label="prefill",
                        info="auto = the method's default",
                    )
                    vision_ahead = gr.Number(
                        1,
                        precision=0,
                        label="blocks per vision-tower call",
                        info="1 = a call per block; more = fewer tower launches, the same embeddings, "
                        "a larger transient (counted by the memory guard)",
                        elem_id="vkv-vision-ahead",
                    )
                with gr.Accordion("Video sampling", open=False):
                    fps = gr.Number(1.0, label="frames per second sampled", elem_id="vkv-fps")
                    max_frames = gr.Number(
                        32,
                        precision=0,
                        label="frames sampled at most",
                        info="an hour at 1 fps is 3600 frames (block-wise methods keep memory bounded)",
                        elem_id="vkv-max-frames",
                    )
            # ---- chat -------------------------------------------------------------------------
            with gr.Column(scale=5, min_width=420):
                chatbot = gr.Chatbot(label="chat", height=340, elem_id="vkv-chat", buttons=["copy"])
                error_md = gr.Markdown("", elem_id="vkv-error")
                chat_input = gr.MultimodalTextbox(
                    placeholder="Attach an image or video, then ask a question about it…",
                    sources=["upload"],
                    file_count="single",
                    show_label=False,
                    elem_id="vkv-input",
                )
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="vkv-send", size="sm", min_width=80)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="vkv-stop", size="sm", min_width=80)
                    new_btn = gr.Button("New chat", elem_id="vkv-new", size="sm", min_width=80)
                    download_btn = gr.DownloadButton(
                        "JSON report", interactive=False, elem_id="vkv-download", size="sm", min_width=80
                    )
                progress_html = gr.HTML("", elem_id="vkv-progress")
                summary_md = gr.Markdown("", elem_id="vkv-summary")
                followup_md = gr.Markdown(
                    text.followup_note(default_method, "reuse"), elem_classes="vkv-small", elem_id="vkv-followup"
                )
                examples = chat_examples(demo_examples)
                # cards with a thumbnail (a video's poster frame) and the question; a click fills the input
                example_gallery = gr.Gallery(
                    example_cards(examples),
                    label="examples (click one; the demo scenes first: visualkv-demo answers those)",
                    columns=4,
                    height="auto",
                    allow_preview=False,
                    object_fit="cover",
                    elem_id="vkv-examples",
                    buttons=[],
                )
                if demo_examples:
                    with gr.Accordion("What visualkv-demo can answer", open=False, elem_id="vkv-demo-help"):
                        gr.Markdown(text.demo_questions_md(question_forms(), demo_examples))
            # ---- results ----------------------------------------------------------------------
            with gr.Column(scale=5, min_width=420, elem_id="vkv-results"):
                with gr.Tabs(overflow_behavior="wrap"):  # every result tab in sight, none in a menu
                    with gr.Tab("Kept tokens"):
                        with gr.Row():
                            layer_dd = gr.Dropdown(
                                ["average"], value="average", label="layer", elem_id="vkv-layer", min_width=120
                            )
                            opacity = gr.Slider(
                                0,
                                1,
                                value=0.6,
                                step=0.05,
                                label="overlay opacity",
                                elem_id="vkv-opacity",
                                min_width=160,
                            )
                            # a value typed outside 0..1 is clamped by the handler instead of being refused by
                            # Gradio's bounds check (an error badge over the view)
                            opacity.preprocess = _lenient_number
                        heat_note = gr.Markdown(text.EMPTY_HEAT_NOTE, elem_classes="vkv-small", elem_id="vkv-heat-note")
                        heatmap = gr.ImageSlider(
                            label="before / after: drag to compare",
                            type="pil",
                            interactive=False,
                            elem_id="vkv-heatmap",
                            max_height=420,
                            buttons=["download", "fullscreen"],
                        )
                    with gr.Tab("Saliency"):
                        sali_note = gr.Markdown("Sali-Cache only.")
                        saliency_img = gr.Gallery(
                            label="saliency per frame (click to zoom)",
                            columns=2,
                            height=300,
                            elem_id="vkv-saliency",
                            object_fit="contain",
                        )
                        tier_img = gr.Gallery(
                            label="precision tiers per frame (click to zoom)",
                            columns=2,
                            height=300,
                            elem_id="vkv-tiers",
                            object_fit="contain",
                        )
                    with gr.Tab("Frames"):
                        timeline_note = gr.Markdown("Video only.")
                        timeline_plot = gr.Plot(label="frame timeline", elem_id="vkv-timeline")
                        thumbs_img = gr.Gallery(
                            label="sampled frames (blue border kept, orange-red skipped; click to zoom)",
                            columns=3,
                            height=300,
                            elem_id="vkv-thumbs",
                            object_fit="contain",
                        )
                    with gr.Tab("Merges"):
                        merge_note = gr.Markdown("LightKV only.")
                        merge_img = gr.Image(label="merge map", type="pil", interactive=False, elem_id="vkv-merge")
                        layer_plot = gr.Plot(label="tokens per layer", elem_id="vkv-layer-tokens")
                    with gr.Tab("Numbers"):
                        numbers_md = gr.Markdown("No turn yet.", elem_id="vkv-numbers")
                    with gr.Tab("Compare"):
                        gr.Markdown(
                            "Runs the chat's media (or a file given here) and one question through several "
                            "methods, each in a fresh cache, with the budget and settings on the left. "
                            "`full` is the reference for agreement. *Stop* ends it at the running method's next "
                            "block or token and keeps the finished rows.",
                            elem_classes="vkv-small",
                        )
                        cmp_methods = gr.CheckboxGroup(
                            method_names,
                            value=[
                                m
                                for m in method_names
                                if m in ("full", "blockwise-snapkv", "post-snapkv", "salicache", "lightkv")
                            ],
                            label="methods",
                            elem_id="vkv-cmp-methods",
                        )
                        cmp_file = gr.File(
                            label="media (optional; default: the chat's)", type="filepath", elem_id="vkv-cmp-file"
                        )
                        cmp_question = gr.Textbox(
                            label="question (default: the chat's first question)", elem_id="vkv-cmp-q"
                        )
                        with gr.Row():
                            cmp_btn = gr.Button("Compare", variant="primary", elem_id="vkv-cmp-run", min_width=80)
                            cmp_stop = gr.Button("Stop", variant="stop", elem_id="vkv-cmp-stop", min_width=80)
                        cmp_status = gr.Markdown("", elem_id="vkv-cmp-status")
                        cmp_table = gr.Dataframe(
                            headers=h.compare_headers, interactive=False, wrap=True, elem_id="vkv-cmp-table"
                        )
                        cmp_plot = gr.Plot(label="KV memory against tokens read", elem_id="vkv-cmp-plot")
                memory_plot = gr.Plot(label="KV memory per prefill block", elem_id="vkv-memory")

        # ---- wiring ---------------------------------------------------------------------------------
        settings = [
            method_dd,
            budget,
            block_size,
            max_new,
            temperature,
            followup,
            prefill,
            vision_ahead,
            fps,
            max_frames,
        ]
        h.method_keys = [(name, key) for name, key, _ in method_inputs]
        method_components = [c for _, _, c in method_inputs]
        chat_outputs = [
            chatbot,
            chat_input,
            state,
            error_md,
            progress_html,
            memory_plot,
            download_btn,
            summary_md,
            followup_md,
        ]
        view_outputs = [
            layer_dd,
            heat_note,
            heatmap,
            sali_note,
            saliency_img,
            tier_img,
            timeline_note,
            timeline_plot,
            thumbs_img,
            merge_note,
            merge_img,
            layer_plot,
            numbers_md,
        ]
        compute = {"concurrency_id": "compute", "concurrency_limit": 1}
        light = {"concurrency_limit": None, "show_progress": "hidden"}

        turn_events = []
        for trigger in (chat_input.submit, send_btn.click):
            # at once (no queue): say where this turn waits while another session's turn runs
            trigger(h.queued, [chat_input, state], [progress_html], queue=False, show_progress="hidden")
            turn = trigger(
                h.chat,
                [chat_input, state, *settings, *method_components],
                chat_outputs,
                show_progress="hidden",
                **compute,
            )
            turn_events += [turn, turn.then(h.views, [state, layer_dd, opacity], view_outputs, **light)]

        def pick_example(evt: gr.SelectData):  # the annotation is how Gradio passes the clicked card
            return examples[evt.index]

        example_gallery.select(pick_example, None, [chat_input], queue=False, show_progress="hidden")
        # Stop answers in the browser at once: the server's own answer can wait behind a loaded machine's
        # stream of block updates. Only a running turn's progress line (not "done…", a queue position or
        # nothing) is replaced, so a Stop with nothing to stop changes nothing.
        stop_btn.click(None, [progress_html], [progress_html], js=_stop_ack_js(), queue=False)
        stop_btn.click(h.stop, [state], [progress_html], queue=False, show_progress="hidden")
        new_btn.click(
            h.new_chat,
            [state, method_dd, followup],
            [
                state,
                chatbot,
                chat_input,
                error_md,
                progress_html,
                memory_plot,
                download_btn,
                summary_md,
                followup_md,
                *view_outputs,
            ],
            cancels=turn_events,
            show_progress="hidden",
            concurrency_limit=None,
        )
        load_btn.click(
            h.load_model,
            [model_dd, model_id, state],
            [state, model_note, error_md, chatbot, progress_html, memory_plot, download_btn, summary_md, *view_outputs],
            show_progress_on=[model_note],
            **compute,
        )
        for control in (method_dd, followup):
            control.change(
                h.method_changed,
                [method_dd, followup, state],
                [method_md, budget, followup_md, *groups.values()],
                queue=False,
                show_progress="hidden",
            )
        h.group_names = list(groups)
        layer_dd.input(h.layer_changed, [state, layer_dd, opacity], [heatmap], **light)
        opacity.release(h.layer_changed, [state, layer_dd, opacity], [heatmap], **light)
        # at once (no queue), as for a chat turn: where the comparison waits
        cmp_btn.click(h.compare_queued, [state], [cmp_status], queue=False, show_progress="hidden")
        cmp_btn.click(
            h.compare,
            [state, cmp_methods, cmp_question, cmp_file, *settings, *method_components],
            [cmp_table, cmp_plot, cmp_status, state],
            show_progress_on=[cmp_table],
            **compute,
        )
        cmp_stop.click(None, [cmp_status], [cmp_status], js=_compare_stop_ack_js(), queue=False)
        cmp_stop.click(h.stop_compare, [state], [cmp_status], queue=False, show_progress="hidden")
    demo.vkv_model = model_name  # for app.py's start message
    demo.vkv_serve = serve  # for launch's queue size
    return demo


def _stop_ack_js() -> str:
    """Browser-side Stop: the progress line of a turn waiting or running (reading, prefilling or answering)
    becomes the "stopping…" line; any other line is returned unchanged."""
    # each label up to its "…": the stopping line has two endings ("(a prefill ends…" and "(after block k/N…")
    running_labels = (WAITING_LABEL, STARTING_LABEL, READING_LABEL, PREFILL_LABEL, STOPPING_LABEL)
    labels = "|".join(re.escape(label.split("…")[0]) for label in running_labels)
    running = rf"vkv-progress-text\">({labels})"
    return f"(p) => (/{running}/.test(p || '') ? {json.dumps(stopping_html())} : p)"


def _compare_stop_ack_js() -> str:
    """Browser-side Stop of Compare: a waiting or running comparison's status line ("waiting: position 2…",
    "running 5 methods…", "2/5 · lightkv: prefill block 3/12", "1/5 done") becomes the "stopping…" line; a
    finished one is returned unchanged."""
    waiting = "|".join(re.escape(label.split("…")[0]) for label in (WAITING_LABEL, STARTING_LABEL))
    running = rf"^({waiting}|running \d+ methods|\d+\/\d+ (·|done))"
    return f"(s) => (/{running}/.test(s || '') ? {json.dumps(COMPARE_STOPPING)} : s)"


def _lenient_number(payload):
    return None if payload is None else float(payload)


def _setting_component(s):
    info = text.SETTING_HELP.get(s.key.rsplit(".", 1)[-1])
    elem_id = "vkv-opt-" + s.key.replace(".", "-").replace("_", "-")
    if s.kind == "bool":
        return gr.Checkbox(value=s.default, label=s.label, info=info, elem_id=elem_id)
    if s.kind == "int":
        return gr.Number(value=s.default, precision=0, label=s.label, info=info, elem_id=elem_id)
    if s.kind == "float":
        return gr.Number(value=s.default, label=s.label, info=info, elem_id=elem_id)
    if s.kind == "choice":
        return gr.Dropdown(list(s.choices), value=s.default, label=s.label, info=info, elem_id=elem_id)
    if s.kind == "floats":
        value = ", ".join(f"{x:g}" for x in s.default) if s.default is not None else ""
        return gr.Textbox(
            value=value,
            label=s.label,
            info=info,
            elem_id=elem_id,
            placeholder="comma-separated; empty = the method's default",
        )
    return gr.Textbox(value=s.default, label=s.label, info=info, elem_id=elem_id)


def launch(demo: gr.Blocks, host: str | None = None, port: int | None = None, share: bool = False) -> None:
    """Queue (one model computation at a time, at most `max_queue` waiting: Gradio then tells the next
    visitor "This application is currently busy. Please try again.") and serve."""
    serve = getattr(demo, "vkv_serve", None) or ServeOptions()
    demo.queue(default_concurrency_limit=1, max_size=serve.max_queue).launch(
        server_name=host,
        server_port=port,
        share=share,
        max_file_size=serve.max_upload_bytes,
        css=CSS,
        ssr_mode=False,
        allowed_paths=[str(ASSETS)],
        show_error=True,
    )
