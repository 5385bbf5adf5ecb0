"""The VisualKV page: `build_app` composes the layout (ui/layout.py) and wires it to the callbacks."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from visualkv.bench.demo_examples import load_demo_examples
from visualkv.runtime.access import ModelPolicy, scrub_paths

from . import text, views
from .api_values import ApiValues, CheckedBlocks
from .bounds import FormBounds, form_bounds
from .callbacks import Callbacks
from .compare import whole_answer
from .evidence import redraw as redraw_evidence
from .evidence import wire_evidence
from .examples import ASSETS, EXAMPLE_NEW_CHAT, chat_started, example_refused
from .gate import QueueGate
from .layout import (
    COMPARE_CSS,
    CSS,
    DEFAULT_METHOD,
    KEPT_TAB_LABEL,
    MEMORY_TAB_LABEL,
    ChatPanel,
    ComparePanel,
    ResultViews,
    SettingsPanel,
    build_chat,
    build_results,
    build_settings,
)
from .loading import start_model
from .queue import COMPUTE_ID, WATCH_SECONDS
from .sharing import ServeOptions, limit_heap_arenas, release_on_close, release_state
from .state import ModelCache, is_offline_model
from .status import compare_stop_ack_js, note_html, open_tab_js, stop_ack_js

COMPUTE = {"concurrency_id": COMPUTE_ID, "concurrency_limit": 1}  # one model computation at a time
# drawing, settings, Stop and New chat: outside the queue, so they run beside a computation and answer even when
# the queue is full (Gradio refuses every queued event then, whatever its concurrency group)
AT_ONCE = {"queue": False, "show_progress": "hidden"}


@dataclass
class Page:
    """Every component the events read or write."""

    state: gr.State
    model_note: gr.Markdown
    settings: SettingsPanel
    chat: ChatPanel
    views: ResultViews
    compare: ComparePanel
    memory_plot: gr.Plot


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
    bounds = form_bounds(serve.public)
    callbacks = Callbacks.create(cache, model_name, serve.turn_time_limit, serve.max_upload_bytes, bounds)
    # delete_cache: uploads and served copies older than 6 h are removed every hour
    with CheckedBlocks(title="VisualKV", analytics_enabled=False, delete_cache=(3600, 6 * 3600)) as demo:
        page = _build_page(demo, model_name, start_error, policy, bounds)
        demo.api_values = ApiValues(bounds)  # every event's raw values, checked before Gradio preprocesses them
        demo.api_values.add_form(page.settings)
        demo.api_values.add_methods(page.settings.method_inputs)
        demo.api_values.add_clamped(page.views.opacity)  # clamped by its callback, as the page lets one type
        callbacks.context.method_keys = page.settings.method_keys
        callbacks.method_choice.group_names = list(page.settings.groups)
        callbacks.comparisons.method_names = [value for _, value in page.compare.methods.choices]
        callbacks.queue.attach(demo)  # positions are read from this page's Gradio queue
        _wire_chat(page, callbacks)
        _wire_model_and_method(page, callbacks)
        _wire_result_views(page)
        _wire_compare(page, callbacks)
        wire_evidence(page, callbacks.context.turn_time_limit, callbacks.queue.active)
    demo.vkv_model = model_name  # for app.py's start message
    demo.vkv_serve = serve  # for launch's queue size
    demo.vkv_queue = callbacks.queue  # for launch's gate
    return demo


def _build_page(
    demo: gr.Blocks, model_name: str, start_error: str | None, policy: ModelPolicy, bounds: FormBounds
) -> Page:
    """The components, top to bottom and left to right, and the session state's cleanup."""
    state = gr.State(None, time_to_live=4 * 3600, delete_callback=release_state)
    release_on_close(demo, state)  # a closed tab's cache is freed at once
    limit_heap_arenas()  # ... and its memory goes back to the OS, not into one of many thread arenas
    gr.Markdown(text.INTRO, elem_id="vkv-title")
    model_note = gr.Markdown(
        text.offline_note(model_name, is_offline_model(model_name), start_error),
        elem_id="vkv-model-note",
        elem_classes="vkv-small",
    )
    method_names = text.method_choices()
    default_method = DEFAULT_METHOD if DEFAULT_METHOD in method_names else method_names[0]
    demo_examples = load_demo_examples()
    with gr.Row(equal_height=False):
        settings = build_settings(model_name, method_names, default_method, policy, bounds)
        chat = build_chat(default_method, demo_examples)
        result_views, compare, memory_plot = build_results(method_names)
    return Page(state, model_note, settings, chat, result_views, compare, memory_plot)


def _turn_outputs(page: Page) -> list:
    """What a chat turn writes (in the order of `ui.chat.ChatCallbacks.chat`'s outputs)."""
    chat = page.chat
    return [
        chat.chatbot,
        chat.chat_input,
        page.state,
        chat.error_md,
        chat.progress_html,
        page.memory_plot,
        chat.download_btn,
        chat.summary_md,
        chat.followup_md,
    ]


def _wire_chat(page: Page, callbacks: Callbacks) -> None:
    """Send (Enter or the button), the example cards, Stop and New chat."""
    chat, turns, state = page.chat, callbacks.turns, page.state
    turn_inputs = [chat.chat_input, state, *page.settings.inputs, *page.settings.method_components]
    view_inputs, view_outputs = [state, page.views.layer_dd, page.views.opacity], page.views.outputs
    compare = page.compare
    turn_events = []
    # where a sent turn waits in Gradio's queue: the page sends a click's events one after the other, the turn's
    # join after the at-once ones answered, so the send starts this watch and its ticks read the queue
    watch = gr.Timer(WATCH_SECONDS, active=False)
    watch.tick(turns.where, None, [chat.progress_html, watch], **AT_ONCE)
    for trigger in (chat.chat_input.submit, chat.send_btn.click):
        # at once (no queue), just before the turn joins Gradio's queue (the page sends them in this order): say
        # where it will wait there. In the browser first: a new media's prefill shows its live memory chart beside
        # the chat, and its kept tokens once it is done (a follow-up, and a turn that gave its question back, leave
        # the tabs as they are)
        attached = "document.querySelectorAll('#vkv-input .thumbnail-item').length > 0"
        trigger(
            turns.queued,
            [chat.chat_input, state],
            [watch, chat.notice_md],
            js=open_tab_js(MEMORY_TAB_LABEL, attached, passes=2),
            **AT_ONCE,
        )
        turn = trigger(turns.chat, turn_inputs, _turn_outputs(page), show_progress="hidden", **COMPUTE)
        callbacks.queue.register("turn", turn)
        turn_events.append(turn)
        # a refused card's line ends with the turn
        emptied = "!document.querySelector('#vkv-input textarea').value"
        # in the browser alone: a server round trip would show Gradio's timer in the emptied line
        clear_notice = f"() => {{ ({open_tab_js(KEPT_TAB_LABEL, emptied)})(); return ''; }}"
        turn.then(None, None, [chat.notice_md], js=clear_notice, **AT_ONCE)
        drawn = turn.then(views.views, view_inputs, view_outputs, **AT_ONCE)
        drawn.then(redraw_evidence, view_inputs, page.views.evidence.outputs, **AT_ONCE)
        # the chat's media may be of another kind now: Compare's default ticks follow it
        drawn.then(
            callbacks.comparisons.ticks_for_media, [state, compare.file, compare.methods], [compare.methods], **AT_ONCE
        )

    # Stop answers in the browser at once: the server's own answer can wait behind a loaded machine's
    # stream of block updates. Only a running turn's progress line (not "done…", a queue position or
    # nothing) is replaced, so a Stop with nothing to stop changes nothing.
    chat.stop_btn.click(None, [chat.progress_html], [chat.progress_html], js=stop_ack_js(), queue=False)
    # it stops a running comparison too: Compare's status line answers as to Compare's own Stop
    chat.stop_btn.click(None, [page.compare.status], [page.compare.status], js=compare_stop_ack_js(), queue=False)
    chat.stop_btn.click(turns.stop, [state], [chat.progress_html], **AT_ONCE)
    new_chat_outputs = [
        state,
        chat.chatbot,
        chat.chat_input,
        chat.error_md,
        chat.progress_html,
        page.memory_plot,
        chat.download_btn,
        chat.summary_md,
        chat.followup_md,
        *view_outputs,
        *_compare_results(page),
    ]

    _wire_cards(page, callbacks, new_chat_outputs)

    # its waiting turns are cancelled (Gradio's `cancels`); a running one is dropped by the state's epoch
    chat.new_btn.click(
        turns.new_chat,
        [state, page.settings.method_dd, page.settings.followup],
        new_chat_outputs,
        cancels=turn_events,
        **AT_ONCE,
    )


def _wire_cards(page: Page, callbacks: Callbacks, new_chat_outputs: list) -> None:
    """The example cards: a click fills the input (a new chat first on a started one), or is refused in one line
    while this session runs something."""
    chat, turns, state = page.chat, callbacks.turns, page.state

    # the annotation is how Gradio passes the clicked card
    def pick_example(evt: gr.SelectData, state, method, followup):
        """A card fills the input; on a chat that has begun it starts a new chat first, and says so. While this
        session runs something, the card is refused in one line (the running work and its lines stay)."""
        running = callbacks.queue.active.get(id(state)) if state is not None else None
        if running:
            skipped = [gr.skip()] * len(new_chat_outputs)
            return (*skipped, example_refused(running))
        example = chat.examples[evt.index]
        if not chat_started(state):
            return (*(example if k == 2 else gr.skip() for k in range(len(new_chat_outputs))), "")
        cleared = list(turns.new_chat(state, method, followup))
        cleared[2], cleared[4] = example, note_html(EXAMPLE_NEW_CHAT)  # the input, the progress line
        return (*cleared, "")

    chat.example_gallery.select(
        pick_example,
        [state, page.settings.method_dd, page.settings.followup],
        [*new_chat_outputs, chat.notice_md],
        **AT_ONCE,
    )


def _compare_results(page: Page) -> list:
    """What a comparison shows (emptied by New chat and Load model: the results were about the old chat)."""
    return [page.compare.table, page.compare.plot, page.compare.status, page.compare.answer]


def _wire_model_and_method(page: Page, callbacks: Callbacks) -> None:
    """Load model, and a new method or follow-up choice."""
    settings, chat = page.settings, page.chat
    load_outputs = [page.state, page.model_note, chat.error_md, chat.chatbot, chat.progress_html, page.memory_plot]
    load = settings.load_btn.click(
        callbacks.loading.load_model,
        [settings.model_dd, settings.model_id, page.state],
        [*load_outputs, chat.download_btn, chat.summary_md, *page.views.outputs, *_compare_results(page)],
        show_progress_on=[page.model_note],
        **COMPUTE,
    )
    callbacks.queue.register("load", load)
    for control in (settings.method_dd, settings.followup):
        control.change(
            callbacks.method_choice.method_changed,
            [settings.method_dd, settings.followup, page.state],
            [settings.method_md, settings.keep, settings.budget, chat.followup_md, *settings.groups.values()],
            **AT_ONCE,
        )


def _wire_result_views(page: Page) -> None:
    """A new layer or overlay opacity redraws the before/after slider."""
    result_views = page.views
    inputs = [page.state, result_views.layer_dd, result_views.opacity]
    outputs = [result_views.heat_note, result_views.heatmap]
    result_views.layer_dd.input(views.layer_changed, inputs, outputs, **AT_ONCE)
    # typed or dragged: applied as it changes (only the latest value is drawn while one is being drawn)
    result_views.opacity.input(views.layer_changed, inputs, outputs, trigger_mode="always_last", **AT_ONCE)


def _wire_compare(page: Page, callbacks: Callbacks) -> None:
    """Compare (its queue line at once, then the run), Compare's own Stop, and its ticks following its file."""
    compare, comparisons, state = page.compare, callbacks.comparisons, page.state
    # where the comparison waits in Gradio's queue, watched as a chat turn's
    watch = gr.Timer(WATCH_SECONDS, active=False)
    watch.tick(comparisons.compare_where, None, [compare.status, watch], **AT_ONCE)
    compare.run_btn.click(comparisons.compare_queued, [state], [watch], **AT_ONCE)
    # the whole answer of a clicked row, under the table; a new comparison empties it (in the browser, at once)
    compare.table.select(whole_answer, None, [compare.answer], **AT_ONCE)
    compare.run_btn.click(None, None, [compare.answer], js="() => ''", queue=False)
    run = compare.run_btn.click(
        comparisons.compare,
        [
            state,
            compare.methods,
            compare.question,
            compare.file,
            compare.evidence,
            *page.settings.inputs,
            *page.settings.method_components,
        ],
        [compare.table, compare.plot, compare.status, state],
        show_progress_on=[compare.table],
        **COMPUTE,
    )
    callbacks.queue.register("compare", run)
    run.then(None, None, [page.chat.notice_md], js="() => ''", **AT_ONCE)  # a refused card's line ends with it
    compare.stop_btn.click(None, [compare.status], [compare.status], js=compare_stop_ack_js(), queue=False)
    compare.stop_btn.click(comparisons.stop_compare, [state], [compare.status], **AT_ONCE)
    # a file given here sets the default ticks for its kind of media (unless the ticks are the user's own)
    compare.file.change(
        comparisons.ticks_for_media, [state, compare.file, compare.methods], [compare.methods], **AT_ONCE
    )


def launch(demo: gr.Blocks, host: str | None = None, port: int | None = None, share: bool = False) -> None:
    """Queue (one model computation at a time, at most `max_queue` waiting: Gradio then tells the next
    visitor "This application is currently busy. Please try again.") and serve."""
    serve = getattr(demo, "vkv_serve", None) or ServeOptions()
    demo.queue(default_concurrency_limit=1, max_size=serve.max_queue)
    # one computation per session, a few sessions per visitor: checked before Gradio queues a computation
    where = " on this shared instance" if serve.public else ""
    QueueGate(demo.vkv_queue, serve.max_client_sessions, where).install(demo)
    demo.launch(
        server_name=host,
        server_port=port,
        share=share,
        max_file_size=serve.max_upload_bytes,
        css=CSS + COMPARE_CSS,
        ssr_mode=False,
        allowed_paths=[str(ASSETS)],
        show_error=True,
    )
