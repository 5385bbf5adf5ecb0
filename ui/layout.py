"""The page's components: settings on the left, the chat in the middle, the results on the right.

Layout (one screen at 1440x900): the chat with its progress and one-line summary, examples under its input;
the results show kept tokens before/after first, the other views in tabs, the memory chart under them.
Builders only create components; ui/app.py wires them to the callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from visualkv.bench.demo_examples import DemoExample, question_forms
from visualkv.models.registry import HUB_MODELS, OFFLINE_MODELS, offline_aliases
from visualkv.report import viz
from visualkv.report.compare import COMPARE_COLUMN_WIDTHS
from visualkv.runtime.access import ModelPolicy
from visualkv.runtime.streaming import method_settings

from . import text
from .bounds import LOCAL, FormBounds
from .compare import default_ticks
from .evidence import build_evidence_tab
from .examples import chat_examples, example_cards
from .forms import DEFAULTS

DEFAULT_METHOD = DEFAULTS.method

CSS = """
#vkv-error {color: #b00020; font-weight: 600;}
#vkv-error:empty {display: none;}
/* the chat column's lines take no room while empty, so the example cards stay in view on a first visit */
#vkv-summary:has(span.md:empty), #vkv-followup:has(span.md:empty), #vkv-notice:has(span.md:empty),
  #vkv-progress:has(.prose:empty) {display: none;}
#vkv-title h2 {font-size: 1.35em; margin: 0 0 2px 0;}
/* a chart shows once something draws it */
#vkv-cmp-plot:has(> .empty) {display: none;}
#vkv-notice {color: #8a4b00; font-weight: 600;}
#vkv-progress .vkv-bar {width: 100%; height: 14px;}
#vkv-progress .vkv-progress-text {font-size: 0.88em; line-height: 1.3;}
/* a sent picture or video stays small in the chat: the progress line and the live chart stay in view beside it */
#vkv-chat .message img, #vkv-chat .message video {max-height: 110px !important; width: auto !important;}
#vkv-summary {font-weight: 600;}
.vkv-small {font-size: 0.9em; opacity: 0.85;}
/* example cards: a thumbnail with the whole question under it (Gradio would cut the caption to one line) */
#vkv-examples .caption-label {white-space: normal !important; overflow: visible !important; max-width: 100% !important;
  text-overflow: clip !important; position: static !important; font-size: 0.8em; line-height: 1.2;}
#vkv-examples .thumbnail-item {flex-direction: column; aspect-ratio: auto !important; height: auto !important;}
#vkv-examples .thumbnail-item img {height: 56px !important; object-fit: cover;}
#vkv-examples .grid-wrap {min-height: 0 !important; height: auto !important; max-height: none !important;}
#vkv-examples .grid-container {padding-top: 32px !important;}  /* below the gallery's floating label */
#vkv-results button[role=tab] {padding: 4px 9px; font-size: 0.92em;}  /* all six result tabs fit in one row */
/* the before/after view starts under its floating label and toolbar, which would cover its first row of frames */
#vkv-heatmap .image-container {padding-top: 30px; box-sizing: border-box;}
/* the result galleries' captions: the whole text, wrapped, under the picture (Gradio cuts them to one line) */
#vkv-saliency .caption-label, #vkv-tiers .caption-label, #vkv-thumbs .caption-label {white-space: normal !important;
  overflow: visible !important; text-overflow: clip !important; max-width: 100% !important;
  position: static !important; font-size: 12px; line-height: 1.25;}
#vkv-saliency .thumbnail-item, #vkv-tiers .thumbnail-item, #vkv-thumbs .thumbnail-item {flex-direction: column;
  aspect-ratio: auto !important; height: auto !important;}
#vkv-saliency .grid-wrap, #vkv-tiers .grid-wrap, #vkv-thumbs .grid-wrap {height: auto !important;
  max-height: 560px !important;}
#vkv-saliency .grid-container, #vkv-tiers .grid-container, #vkv-thumbs .grid-container {padding-top: 32px !important;}
/* the colour legends of the Saliency tab: page text, readable at any gallery width */
.vkv-legend {font-size: 12px; display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: center; margin: 2px 0;}
.vkv-legend .vkv-swatch {display: inline-block; width: 12px; height: 12px; border: 1px solid #000;
  vertical-align: -2px; margin-right: 4px;}
.vkv-legend .vkv-ramp {display: inline-block; width: 180px; height: 12px; border: 1px solid #000;
  vertical-align: -2px; margin: 0 4px;}
/* a control the chosen method does not use looks switched off, not editable */
#vkv-budget input:disabled, #vkv-keep input:disabled {background: repeating-linear-gradient(45deg, #eee, #eee 6px, #e2e2e2 6px, #e2e2e2 12px);
  color: #888; cursor: not-allowed;}
"""


@dataclass
class SettingsPanel:
    """The settings column."""

    model_dd: gr.Dropdown
    model_id: gr.Textbox
    load_btn: gr.Button
    method_dd: gr.Dropdown
    method_md: gr.Markdown
    budget: gr.Number
    keep: gr.Number
    block_size: gr.Number
    method_inputs: list[tuple[str, str, gr.components.Component]]  # (method, setting key, its input)
    groups: dict[str, gr.Accordion]  # each method's settings group
    max_new: gr.Number
    temperature: gr.Number
    followup: gr.Radio
    prefill: gr.Dropdown
    vision_ahead: gr.Number
    fps: gr.Number
    max_frames: gr.Number

    @property
    def inputs(self) -> list:
        """The fields every computation reads, in the order of `ui.forms.FormValues`."""
        return [
            self.method_dd,
            self.budget,
            self.keep,
            self.block_size,
            self.max_new,
            self.temperature,
            self.followup,
            self.prefill,
            self.vision_ahead,
            self.fps,
            self.max_frames,
        ]

    @property
    def method_components(self) -> list:
        return [component for _, _, component in self.method_inputs]

    @property
    def method_keys(self) -> list[tuple[str, str]]:
        return [(name, key) for name, key, _ in self.method_inputs]


@dataclass
class ChatPanel:
    """The chat column: the conversation, its input and buttons, progress, summary and examples."""

    chatbot: gr.Chatbot
    error_md: gr.Markdown
    chat_input: gr.MultimodalTextbox
    send_btn: gr.Button
    stop_btn: gr.Button
    new_btn: gr.Button
    download_btn: gr.DownloadButton
    progress_html: gr.HTML
    summary_md: gr.Markdown
    followup_md: gr.Markdown
    examples: list[dict]  # what a click on each card puts into the input
    example_gallery: gr.Gallery
    notice_md: gr.Markdown | None = None  # a card clicked while something runs: why it was not loaded


@dataclass
class ResultViews:
    """The result tabs a turn fills (all but Compare)."""

    layer_dd: gr.Dropdown
    opacity: gr.Slider
    heat_note: gr.Markdown
    heatmap: gr.ImageSlider
    sali_note: gr.Markdown
    saliency_legend: gr.HTML
    saliency_img: gr.Gallery
    tier_legend: gr.HTML
    tier_img: gr.Gallery
    timeline_note: gr.Markdown
    timeline_plot: gr.Plot
    thumbs_img: gr.Gallery
    merge_note: gr.Markdown
    merge_img: gr.Image
    layer_plot: gr.Plot
    numbers_md: gr.Markdown
    evidence: Any = None  # the Evidence tab (ui/evidence.py's EvidencePanel), beside Kept tokens

    @property
    def outputs(self) -> list:
        """What `ui.views.views` fills, in its order."""
        return [
            self.layer_dd,
            self.heat_note,
            self.heatmap,
            self.sali_note,
            self.saliency_legend,
            self.saliency_img,
            self.tier_legend,
            self.tier_img,
            self.timeline_note,
            self.timeline_plot,
            self.thumbs_img,
            self.merge_note,
            self.merge_img,
            self.layer_plot,
            self.numbers_md,
        ]


@dataclass
class ComparePanel:
    """The Compare tab."""

    methods: gr.CheckboxGroup
    file: gr.File
    question: gr.Textbox
    run_btn: gr.Button
    stop_btn: gr.Button
    status: gr.Markdown
    table: gr.Dataframe
    plot: gr.Plot
    evidence: gr.Checkbox | None = None  # opt-in: an evidence recall column (a second pass per method)
    answer: gr.Markdown | None = None  # the clicked row's whole answer (the table shows one line of each)


def model_choices(current: str, policy: ModelPolicy | None = None) -> list[str]:
    """The model dropdown: offline models and aliases first, then Hub models (and `current` if none of them);
    on a shared instance only those its `policy` loads (a listed model must never be refused)."""
    names = list(dict.fromkeys([*(c.name for c in OFFLINE_MODELS), *offline_aliases(), *(c.name for c in HUB_MODELS)]))
    if policy is not None:
        names = [name for name in names if policy.permits(name)]
    return names if current in names else [current, *names]


# -- settings column ------------------------------------------------------------------------------------


def build_settings(
    model_name: str,
    method_names: list[str],
    default_method: str,
    policy: ModelPolicy | None = None,
    bounds: FormBounds = LOCAL,
) -> SettingsPanel:
    with gr.Column(scale=2, min_width=250, elem_id="vkv-settings"):
        with gr.Accordion("Model", open=True):
            model_dd = gr.Dropdown(
                model_choices(model_name, policy),
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
        method_md = gr.Markdown(text.method_line(default_method), elem_id="vkv-method-help", elem_classes="vkv-small")
        with gr.Accordion("Methods and terms, explained", open=False, elem_id="vkv-words"):
            gr.Markdown(text.methods_in_plain_words(method_names), elem_classes="vkv-small")
            gr.Markdown(text.GLOSSARY, elem_classes="vkv-small")
        keep, budget, block_size = _budget_and_block_size(default_method)
        method_inputs, groups = _method_groups(method_names, default_method)
        generation = _generation_box(bounds)
        fps, max_frames = _video_sampling_box(bounds)
    return SettingsPanel(
        model_dd, model_id, load_btn, method_dd, method_md, budget, keep, block_size, method_inputs, groups,
        *generation, fps, max_frames,
    )  # fmt: skip


def _budget_and_block_size(default_method: str) -> tuple[gr.Number, gr.Number, gr.Number]:
    """keep % (the default budget: a share of the media's visual tokens), budget M (a fixed one) and block size."""
    # no minimum/maximum on number fields: Gradio would reject a bad value with an error badge
    # over the outputs; the callbacks check every value and say what is wrong in one line
    uses_budget = text.traits(default_method).needs_budget
    keep = gr.Number(
        DEFAULTS.keep,
        label="keep % of the visual tokens",
        info=text.keep_info(default_method),
        elem_id="vkv-keep",
        interactive=uses_budget,
    )
    budget = gr.Number(
        DEFAULTS.budget,
        precision=0,
        label="budget M (0 = keep %)",
        info=text.budget_info(default_method),
        elem_id="vkv-budget",
        interactive=uses_budget,
    )
    block_size = gr.Number(
        DEFAULTS.block_size,
        precision=0,
        label="block size",
        info="visual tokens per prefill block; 0 = auto (the model's default)",
        elem_id="vkv-block-size",
    )
    return keep, budget, block_size


def _method_groups(method_names: list[str], default_method: str):
    """One settings group per method with settings; only the chosen method's is visible."""
    method_inputs, groups = [], {}
    for name in method_names:
        settings = method_settings(name)
        if not settings:
            continue
        with gr.Accordion(f"{name} settings", open=False, visible=name == default_method) as group:
            gr.Markdown(text.traits(name).description or name, elem_classes="vkv-small")
            for s in settings:
                method_inputs.append((name, s.key, setting_component(s)))
        groups[name] = group
    return method_inputs, groups


def setting_component(s) -> gr.components.Component:
    """The input for one method setting (`visualkv.runtime.streaming.method_settings`)."""
    info = s.help or None
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


def _generation_box(bounds: FormBounds) -> tuple:
    """max new tokens, temperature, follow-up, prefill, blocks per vision-tower call."""
    with gr.Accordion("Generation and follow-ups", open=False):
        max_new = gr.Number(
            DEFAULTS.max_new,
            precision=0,
            label="max new tokens",
            info=f"1 to {bounds.max_new:,}",
            elem_id="vkv-max-new",
        )
        temperature = gr.Number(
            DEFAULTS.temperature,
            label="temperature",
            info=f"0 = greedy; up to {bounds.temperature:g}",
            elem_id="vkv-temperature",
        )
        followup = gr.Radio(
            text.FOLLOWUP_CHOICES,
            value=DEFAULTS.followup,
            label="follow-up turns",
            info="keep what the first question kept, or read the media again for each question "
            "(matters for methods that look at the question)",
        )
        prefill = gr.Dropdown(
            text.PREFILL_CHOICES,
            value=DEFAULTS.prefill,
            label="prefill: how the media is read",
            elem_id="vkv-prefill",
            info="in blocks, the cache never holds more than the budget plus one block; all at once holds "
            "the whole media before it is compressed",
        )
        vision_ahead = gr.Number(
            DEFAULTS.vision_ahead,
            precision=0,
            label="blocks per vision-tower call",
            info=f"1 to {bounds.vision_ahead}: 1 = a call per block; more = fewer tower launches, the same "
            "embeddings, a larger transient (counted by the memory guard)",
            elem_id="vkv-vision-ahead",
        )
    return max_new, temperature, followup, prefill, vision_ahead


def _video_sampling_box(bounds: FormBounds) -> tuple[gr.Number, gr.Number]:
    with gr.Accordion("Video sampling", open=False):
        fps = gr.Number(
            DEFAULTS.fps, label="frames per second sampled", info=f"up to {bounds.fps:g}", elem_id="vkv-fps"
        )
        max_frames = gr.Number(
            DEFAULTS.max_frames,
            precision=0,
            label="frames sampled at most",
            info=f"1 to {bounds.max_frames:,}; an hour at 1 fps is 3,600 frames (block-wise methods keep memory "
            "bounded)",
            elem_id="vkv-max-frames",
        )
    return fps, max_frames


# -- chat column ----------------------------------------------------------------------------------------


def build_chat(default_method: str, demo_examples: list[DemoExample]) -> ChatPanel:
    with gr.Column(scale=5, min_width=420):
        # as tall as its messages (up to 340 px): an empty chat leaves the example cards in view
        chatbot = gr.Chatbot(
            label="chat", height=None, min_height=80, max_height=340, elem_id="vkv-chat", buttons=["copy"]
        )
        error_md = gr.Markdown("", elem_id="vkv-error")
        chat_input = gr.MultimodalTextbox(
            placeholder="Attach an image or video, then ask a question about it…",
            sources=["upload"],
            file_count="single",
            show_label=False,
            submit_btn=False,  # one send control: the Send button below (Enter sends too)
            elem_id="vkv-input",
        )
        with gr.Row():
            send_btn = gr.Button("Send", variant="primary", elem_id="vkv-send", size="sm", min_width=80)
            stop_btn = gr.Button("Stop", variant="stop", elem_id="vkv-stop", size="sm", min_width=80)
            new_btn = gr.Button("New chat", elem_id="vkv-new", size="sm", min_width=80)
            download_btn = gr.DownloadButton(
                "JSON report", interactive=False, elem_id="vkv-download", size="sm", min_width=80
            )
        notice_md = gr.Markdown("", elem_id="vkv-notice")
        progress_html = gr.HTML("", elem_id="vkv-progress")
        summary_md = gr.Markdown("", elem_id="vkv-summary")
        # what a follow-up question means: said once a chat exists (before any chat it is noise)
        followup_md = gr.Markdown("", elem_classes="vkv-small", elem_id="vkv-followup")
        examples, example_gallery = _examples_box(demo_examples)
    return ChatPanel(
        chatbot, error_md, chat_input, send_btn, stop_btn, new_btn, download_btn, progress_html, summary_md,
        followup_md, examples, example_gallery, notice_md,
    )  # fmt: skip


def _examples_box(demo_examples: list[DemoExample]) -> tuple[list[dict], gr.Gallery]:
    """Cards with a thumbnail (a video's poster frame) and the question; a click fills the input."""
    examples = chat_examples(demo_examples)
    gallery = gr.Gallery(
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
    return examples, gallery


# -- results column -------------------------------------------------------------------------------------


#: the result tabs a turn switches between: the live memory chart while a new media is read, then the kept tokens
KEPT_TAB_LABEL, MEMORY_TAB_LABEL = "Kept tokens", "Memory"


def build_results(method_names: list[str]) -> tuple[ResultViews, ComparePanel, gr.Plot]:
    """The result tabs (the memory chart's among them, beside the chat and its progress line while a prefill runs)
    and the Compare tab."""
    # every result tab in sight, none in a menu
    with gr.Column(scale=5, min_width=420, elem_id="vkv-results"), gr.Tabs(overflow_behavior="wrap"):
        kept = _kept_tokens_tab()
        with gr.Tab(MEMORY_TAB_LABEL):
            memory_plot = gr.Plot(label="KV memory per prefill block", elem_id="vkv-memory")
        evidence = build_evidence_tab()
        views = ResultViews(*kept, *_saliency_tab(), *_frames_tab(), *_merges_tab(), _numbers_tab(), evidence)
        compare = _compare_tab(method_names)
    return views, compare, memory_plot


def _kept_tokens_tab() -> tuple:
    with gr.Tab(KEPT_TAB_LABEL):
        with gr.Row():
            layer_dd = gr.Dropdown(["average"], value="average", label="layer", elem_id="vkv-layer", min_width=120)
            opacity = gr.Slider(
                0, 1, value=0.6, step=0.05, label="overlay opacity", elem_id="vkv-opacity", min_width=160
            )
            # a value typed outside 0..1 is clamped by the callback instead of being refused by
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
    return layer_dd, opacity, heat_note, heatmap


def _lenient_number(payload):
    return None if payload is None else float(payload)


def _saliency_tab() -> tuple:
    with gr.Tab("Saliency"):
        sali_note = gr.Markdown("Sali-Cache only.")
        saliency_legend = gr.HTML("", elem_id="vkv-saliency-legend")
        saliency_img = gr.Gallery(
            label="saliency per frame (click to zoom)",
            columns=2,
            height=300,
            elem_id="vkv-saliency",
            object_fit="contain",
        )
        tier_legend = gr.HTML("", elem_id="vkv-tier-legend")
        tier_img = gr.Gallery(
            label="precision tiers per frame (click to zoom)",
            columns=2,
            height=300,
            elem_id="vkv-tiers",
            object_fit="contain",
        )
    return sali_note, saliency_legend, saliency_img, tier_legend, tier_img


def _frames_tab() -> tuple:
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
    return timeline_note, timeline_plot, thumbs_img


def _merges_tab() -> tuple:
    with gr.Tab("Merges"):
        merge_note = gr.Markdown("LightKV only.")
        merge_img = gr.Image(label="merge map", type="pil", interactive=False, elem_id="vkv-merge")
        layer_plot = gr.Plot(label="tokens per layer", elem_id="vkv-layer-tokens")
    return merge_note, merge_img, layer_plot


def _numbers_tab() -> gr.Markdown:
    with gr.Tab("Numbers"):
        return gr.Markdown("No turn yet.", elem_id="vkv-numbers")


COMPARE_CSS = """
/* Compare's table fits its panel: a small proportional font, headers and numbers broken only between words,
   method names and answers wrapped anywhere (the column widths are COMPARE_COLUMN_WIDTHS) */
#vkv-cmp-table .table-wrap, #vkv-cmp-table .table-wrap * {font-family: var(--font) !important;
  font-size: 12px !important; line-height: 1.3 !important;}
#vkv-cmp-table .header-cell, #vkv-cmp-table .body-cell {padding: 3px 4px !important;}
#vkv-cmp-table .cell-wrap {padding: 0 !important;}
#vkv-cmp-table .wrap {word-break: normal !important; overflow-wrap: normal !important;}
#vkv-cmp-table .body-cell:first-child .wrap, #vkv-cmp-table .body-cell:last-child .wrap {
  overflow-wrap: anywhere !important;}
#vkv-cmp-table .cell-menu-button {display: none !important;}
/* one line per method: each answer cut to the answer column's width (a click on its row shows it whole, under
   the table), so the rows and the chart under them stay in view however long the answers */
#vkv-cmp-table .body-cell:last-child .wrap {white-space: nowrap !important; overflow: hidden !important;
  text-overflow: ellipsis !important; display: block !important;}
#vkv-cmp-answer:has(span.md:empty) {display: none;}
"""


def _compare_tab(method_names: list[str]) -> ComparePanel:
    """Run and Stop first, then the results (in view after a run, without scrolling), then what to compare (a
    collapsible group: before a first run the empty results take no room, so it is in view too)."""
    with gr.Tab("Compare"):
        with gr.Row():
            run_btn = gr.Button("Compare", variant="primary", elem_id="vkv-cmp-run", min_width=80, size="sm")
            stop_btn = gr.Button("Stop", variant="stop", elem_id="vkv-cmp-stop", min_width=80, size="sm")
        status = gr.Markdown("", elem_id="vkv-cmp-status")
        table = gr.Dataframe(
            headers=viz.COMPARE_HEADERS,
            interactive=False,
            wrap=True,
            column_widths=COMPARE_COLUMN_WIDTHS,
            max_height=260,  # the chart under it starts in view; more rows scroll inside the table
            elem_id="vkv-cmp-table",
        )
        answer = gr.Markdown("", elem_id="vkv-cmp-answer", elem_classes="vkv-small")
        plot = gr.Plot(label="KV memory: held after each block, and at its peak", elem_id="vkv-cmp-plot")
        with gr.Accordion("what to compare: methods, question, media", open=True, elem_id="vkv-cmp-choice"):
            methods = gr.CheckboxGroup(
                method_names,
                value=default_ticks("image", method_names),
                label="methods",
                info="ticked by default: those that suit the media (Sali-Cache's frame skipping and EVS for a video only)",
                elem_id="vkv-cmp-methods",
            )
            question = gr.Textbox(label="question (default: the chat's first question)", elem_id="vkv-cmp-q")
            evidence = gr.Checkbox(
                False,
                label="evidence recall column (a second, uncompressed pass per method)",
                elem_id="vkv-cmp-evidence",
            )
            file = gr.File(
                label="media (optional; default: the chat's)", type="filepath", elem_id="vkv-cmp-file", height=90
            )
            gr.Markdown(
                "Runs the chat's media (or a file given here) and one question through several "
                "methods, each in a fresh cache, with the budget and settings on the left. "
                "`full` is the reference for agreement. *Stop* (here or beside the chat) ends it at the running "
                "method's next block or token and keeps the finished rows.",
                elem_classes="vkv-small",
            )
    return ComparePanel(methods, file, question, run_btn, stop_btn, status, table, plot, evidence, answer)
