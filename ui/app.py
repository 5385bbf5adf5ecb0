"""The VisualKV page: layout and wiring only (callbacks in ui/handlers.py, drawing in visualkv/viz.py)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from visualkv.access import ModelPolicy, scrub_paths
from visualkv.demo_examples import DemoExample, load_demo_examples, question_forms
from visualkv.methods import METHODS
from visualkv.models.registry import HUB_MODELS, OFFLINE_MODELS, offline_aliases
from visualkv.streaming import method_settings

from . import text
from .handlers import Handlers
from .sharing import ServeOptions, release_on_close, release_state
from .state import ModelCache, default_offline_model, is_offline_model

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# generic examples: real-looking media for memory and kept-token maps (random-weight or Hub models)
GENERIC_EXAMPLES = [("Where is the small red star?", ASSETS / "example_4k.png"),
                    ("What happens in this video?", ASSETS / "example_video.mp4")]
MAX_UPLOAD = "200mb"  # Gradio's upload limit (MediaLimits then checks pixels, duration, frames)
DEFAULT_METHOD = "blockwise-snapkv"

CSS = """
#vkv-error {color: #b00020; font-weight: 600;}
#vkv-error:empty {display: none;}
#vkv-progress .vkv-bar {width: 100%; height: 14px;}
.vkv-small {font-size: 0.9em; opacity: 0.85;}
"""


def chat_examples(demo: list[DemoExample]) -> list[dict]:
    """The chat box's examples: featured questions on the demo scenes, then the generic media."""
    pairs = [(q.question, e.path) for e in demo for q in e.featured()] + GENERIC_EXAMPLES
    return [{"text": question, "files": [str(path)]} for question, path in pairs]


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
    method_names = list(METHODS)
    demo_examples = load_demo_examples()
    default_method = DEFAULT_METHOD if DEFAULT_METHOD in METHODS else method_names[0]

    # delete_cache: uploads and served copies older than 6 h are removed every hour
    with gr.Blocks(title="VisualKV", analytics_enabled=False, delete_cache=(3600, 6 * 3600)) as demo:
        state = gr.State(None, time_to_live=4 * 3600, delete_callback=release_state)
        release_on_close(demo, state)  # a closed tab's cache is freed at once
        gr.Markdown(text.INTRO)
        model_note = gr.Markdown(text.offline_note(model_name, is_offline_model(model_name), start_error),
                                 elem_id="vkv-model-note")
        with gr.Row():
            # ---- settings ---------------------------------------------------------------------
            with gr.Column(scale=1, min_width=300):
                with gr.Accordion("Model", open=True):
                    model_dd = gr.Dropdown(model_choices(model_name), value=model_name, label="model",
                                           info="offline aliases first; Hub models need network", elem_id="vkv-model")
                    model_id = gr.Textbox(label="…or a Hub id / local folder", placeholder="org/name or /path",
                                          elem_id="vkv-model-id")
                    load_btn = gr.Button("Load model", elem_id="vkv-load")
                method_dd = gr.Dropdown(method_names, value=default_method, label="method", elem_id="vkv-method")
                method_md = gr.Markdown(text.method_line(default_method), elem_id="vkv-method-help")
                budget = gr.Number(1024, precision=0, minimum=1, label="budget M",
                                   info="visual KV entries kept per layer and KV head", elem_id="vkv-budget",
                                   interactive=METHODS[default_method].needs_budget)
                block_size = gr.Number(0, precision=0, minimum=0, label="block size",
                                       info="visual tokens per prefill block; 0 = auto (the model's default)",
                                       elem_id="vkv-block-size")
                method_inputs, groups = [], {}
                for name in method_names:
                    settings = method_settings(name)
                    if not settings:
                        continue
                    with gr.Accordion(f"{name} settings", open=False, visible=name == default_method) as group:
                        gr.Markdown(METHODS[name].description or name, elem_classes="vkv-small")
                        for s in settings:
                            method_inputs.append((name, s.key, _setting_component(s)))
                    groups[name] = group
                with gr.Accordion("Generation and follow-ups", open=False):
                    max_new = gr.Slider(1, 512, value=64, step=1, label="max new tokens", elem_id="vkv-max-new")
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature", info="0 = greedy")
                    followup = gr.Radio(["reuse", "reprefill"], value="reuse", label="follow-up turns",
                                        info="reuse the compressed cache, or rebuild it per question "
                                             "(query-aware methods only)")
                    prefill = gr.Dropdown(["auto", "hybrid", "blockwise", "bulk"], value="auto", label="prefill",
                                          info="auto = the method's default")
                with gr.Accordion("Video sampling", open=False):
                    fps = gr.Number(1.0, minimum=0.01, label="frames per second sampled", elem_id="vkv-fps")
                    max_frames = gr.Number(32, precision=0, minimum=1, label="frames sampled at most",
                                           elem_id="vkv-max-frames")
            # ---- chat -------------------------------------------------------------------------
            with gr.Column(scale=2):
                chatbot = gr.Chatbot(label="chat", height=420, elem_id="vkv-chat", buttons=["copy"])
                error_md = gr.Markdown("", elem_id="vkv-error")
                chat_input = gr.MultimodalTextbox(
                    placeholder="Attach an image or video, then ask a question about it…", sources=["upload"],
                    file_count="single", show_label=False, elem_id="vkv-input",
                )
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="vkv-send")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="vkv-stop")
                    new_btn = gr.Button("New chat", elem_id="vkv-new")
                    download_btn = gr.DownloadButton("JSON report", interactive=False, elem_id="vkv-download")
                followup_md = gr.Markdown(text.followup_note(default_method, "reuse"), elem_classes="vkv-small",
                                          elem_id="vkv-followup")
                gr.Examples(examples=chat_examples(demo_examples), inputs=[chat_input],
                            label="examples (from assets/; the demo scenes first: visualkv-demo answers those)",
                            examples_per_page=8)
                if demo_examples:
                    with gr.Accordion("What visualkv-demo can answer", open=False, elem_id="vkv-demo-help"):
                        gr.Markdown(text.demo_questions_md(question_forms(), demo_examples))
                progress_html = gr.HTML("", elem_id="vkv-progress")
                memory_plot = gr.Plot(label="KV memory per prefill block", elem_id="vkv-memory")
        # ---- after prefill ----------------------------------------------------------------------
        with gr.Tabs():
            with gr.Tab("Kept tokens"):
                layer_dd = gr.Dropdown(["average"], value="average", label="layer", elem_id="vkv-layer")
                heat_note = gr.Markdown("Ask a question about an image or video to see which visual tokens stay "
                                        "in the cache (green kept, red evicted).")
                heatmap = gr.Image(label="kept tokens", type="pil", interactive=False, elem_id="vkv-heatmap",
                                   buttons=["download"])
            with gr.Tab("Saliency and tiers"):
                sali_note = gr.Markdown("Sali-Cache only.")
                with gr.Row():
                    saliency_img = gr.Image(label="saliency", type="pil", interactive=False, elem_id="vkv-saliency")
                    tier_img = gr.Image(label="tiers", type="pil", interactive=False, elem_id="vkv-tiers")
            with gr.Tab("Frame timeline"):
                timeline_note = gr.Markdown("Video only.")
                timeline_plot = gr.Plot(label="frame timeline", elem_id="vkv-timeline")
                thumbs_img = gr.Image(label="sampled frames (green kept, red skipped)", type="pil", interactive=False,
                                      elem_id="vkv-thumbs")
            with gr.Tab("Merge map"):
                merge_note = gr.Markdown("LightKV only.")
                with gr.Row():
                    merge_img = gr.Image(label="merge map", type="pil", interactive=False, elem_id="vkv-merge")
                    layer_plot = gr.Plot(label="tokens per layer", elem_id="vkv-layer-tokens")
            with gr.Tab("Numbers"):
                numbers_md = gr.Markdown("No turn yet.", elem_id="vkv-numbers")
            with gr.Tab("Compare"):
                gr.Markdown("Runs the chat's media (or a file given here) and one question through several methods, "
                            "each in a fresh cache, with the budget and settings on the left. `full` is the "
                            "reference for agreement.", elem_classes="vkv-small")
                with gr.Row():
                    cmp_methods = gr.CheckboxGroup(method_names, value=[m for m in method_names if m in (
                        "full", "blockwise-snapkv", "post-snapkv", "salicache", "lightkv")], label="methods",
                        elem_id="vkv-cmp-methods")
                    cmp_file = gr.File(label="media (optional; default: the chat's)", type="filepath",
                                       elem_id="vkv-cmp-file")
                cmp_question = gr.Textbox(label="question (default: the chat's first question)", elem_id="vkv-cmp-q")
                cmp_btn = gr.Button("Compare", variant="primary", elem_id="vkv-cmp-run")
                cmp_status = gr.Markdown("", elem_id="vkv-cmp-status")
                cmp_table = gr.Dataframe(headers=h.compare_headers, interactive=False, wrap=True, elem_id="vkv-cmp-table")
                cmp_plot = gr.Plot(label="KV memory against tokens read", elem_id="vkv-cmp-plot")

        # ---- wiring ---------------------------------------------------------------------------------
        settings = [method_dd, budget, block_size, max_new, temperature, followup, prefill, fps, max_frames]
        h.method_keys = [(name, key) for name, key, _ in method_inputs]
        method_components = [c for _, _, c in method_inputs]
        chat_outputs = [chatbot, chat_input, state, error_md, progress_html, memory_plot, download_btn]
        view_outputs = [layer_dd, heat_note, heatmap, sali_note, saliency_img, tier_img, timeline_note, timeline_plot,
                        thumbs_img, merge_note, merge_img, layer_plot, numbers_md]
        compute = {"concurrency_id": "compute", "concurrency_limit": 1}
        light = {"concurrency_limit": None, "show_progress": "hidden"}

        turn_events = []
        for trigger in (chat_input.submit, send_btn.click):
            turn = trigger(h.chat, [chat_input, state, *settings, *method_components], chat_outputs,
                           show_progress="minimal", show_progress_on=[chatbot], **compute)
            turn_events += [turn, turn.then(h.views, [state, layer_dd], view_outputs, **light)]
        stop_btn.click(h.stop, [state], [progress_html], queue=False, show_progress="hidden")
        new_btn.click(h.new_chat, [state], [state, chatbot, error_md, progress_html, memory_plot, download_btn,
                                            *view_outputs], cancels=turn_events, show_progress="hidden",
                      concurrency_limit=None)
        load_btn.click(h.load_model, [model_dd, model_id, state],
                       [state, model_note, error_md, chatbot, progress_html, memory_plot, download_btn],
                       show_progress_on=[model_note], **compute)
        method_dd.change(h.method_changed, [method_dd, followup],
                         [method_md, budget, followup_md, *groups.values()], queue=False, show_progress="hidden")
        followup.change(h.method_changed, [method_dd, followup],
                        [method_md, budget, followup_md, *groups.values()], queue=False, show_progress="hidden")
        h.group_names = list(groups)
        layer_dd.input(h.layer_changed, [state, layer_dd], [heatmap], **light)
        cmp_btn.click(h.compare, [state, cmp_methods, cmp_question, cmp_file, *settings, *method_components],
                      [cmp_table, cmp_plot, cmp_status], show_progress_on=[cmp_table], **compute)
    demo.vkv_model = model_name  # for app.py's start message
    demo.vkv_serve = serve  # for launch's queue size
    return demo


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
        return gr.Textbox(value=value, label=s.label, info=info, elem_id=elem_id,
                          placeholder="comma-separated; empty = the method's default")
    return gr.Textbox(value=s.default, label=s.label, info=info, elem_id=elem_id)


def launch(demo: gr.Blocks, host: str | None = None, port: int | None = None, share: bool = False) -> None:
    """Queue (one model computation at a time, at most `max_queue` waiting: Gradio then tells the next
    visitor "This application is currently busy. Please try again.") and serve."""
    serve = getattr(demo, "vkv_serve", None) or ServeOptions()
    demo.queue(default_concurrency_limit=1, max_size=serve.max_queue).launch(
        server_name=host, server_port=port, share=share, max_file_size=MAX_UPLOAD, css=CSS, ssr_mode=False,
        allowed_paths=[str(ASSETS)], show_error=True,
    )
