"""Figures and overlays of visualkv.report, and the streaming helpers of visualkv.runtime.streaming, on small real reports.

Reports come from the tiny offline Qwen2.5-VL on small synthetic media (a second or two each), so the
views are tested on exactly the fields the engine and the methods write.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import numpy as np
import pytest
from PIL import Image

from visualkv.bench.synthetic import image_media, video_media
from visualkv.errors import ConfigError
from visualkv.methods import METHODS
from visualkv.models.registry import load_model
from visualkv.report.applicable import has_merge_map, has_motion, has_saliency, is_video
from visualkv.report.compare import COMPARE_HEADERS, agreement, compare_memory_figure, compare_rows
from visualkv.report.drawing import (
    MIN_SHOWN_TEXT_PX,
    SHOWN_WIDTH_PX,
    grid,
    text_unit,
    with_colour_bar,
    with_legend,
)
from visualkv.report.frames import MAX_FRAMES_SHOWN, frame_gallery, shown_frames
from visualkv.report.lightkv_views import layer_tokens_figure, merge_legend, merge_view
from visualkv.report.memory_chart import MIB, VIDEO_READ, block_memory_figure, budget_kv_bytes, kv_bytes_per_token
from visualkv.report.overlays import (
    retained_view,
    saliency_gallery,
    saliency_view,
    tier_gallery,
    tier_view,
)
from visualkv.report.palette import KEEP_CMAP, KEPT_COLOUR, SKIPPED_COLOUR, colour_map, tier_name
from visualkv.report.tables import PREFILL_ATTENTION, decode_speed, prefill_attention, summary_line, summary_rows
from visualkv.report.telemetry import BlockEvent, TurnRecord
from visualkv.report.timeline import frame_timeline_figure, skipped_spans
from visualkv.runtime.session import ChatSession, SessionConfig
from visualkv.runtime.streaming import (
    compare_methods,
    live_report,
    method_options,
    method_settings,
    stream_turn,
    turn_report,
)

PROMPT = "Where is the red square?"
BUDGET = 24


@pytest.fixture(scope="module")
def adapter():
    return load_model("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def image():
    return image_media(448, 336, seed=1)  # 16 x 12 = 192 visual tokens


def _config(method: str, **kw) -> SessionConfig:
    return SessionConfig(method=method, budget=BUDGET if METHODS[method].needs_budget else None, max_new_tokens=3, **kw)


@pytest.fixture(scope="module")
def snap(adapter, image):
    """A two-turn blockwise-snapkv session on the image, blocks of 2 token rows, with the events it streamed."""
    session = ChatSession(adapter, _config("blockwise-snapkv", block_size=32, prefill="blockwise"))
    events = list(stream_turn(session, PROMPT, image))
    list(stream_turn(session, "And the blue one?"))
    return session, turn_report(session), events


# -- streaming ------------------------------------------------------------------------------------


def test_stream_turn_orders_blocks_then_text_then_done(snap):
    session, report, events = snap
    kinds = [k for k, _ in events]
    assert kinds[-1] == "done" and kinds.count("done") == 1 and "error" not in kinds
    first_text = kinds.index("text")
    assert set(kinds[:first_text]) == {"block"} and set(kinds[first_text:-1]) == {"text"}
    blocks = [p for k, p in events if k == "block"]
    assert all(isinstance(b, BlockEvent) for b in blocks)
    assert [b.index for b in blocks] == list(range(len(blocks))) and blocks[-1].n_blocks == len(blocks)
    record = events[-1][1]
    assert isinstance(record, TurnRecord) and record is session.turns[0]
    assert "".join(p for k, p in events if k == "text") == record.answer
    assert len(report["turns"]) == 2


def test_stream_turn_reports_errors_as_one_event_and_keeps_the_session(adapter, image):
    session = ChatSession(adapter, _config("blockwise-keydiff"))
    events = list(stream_turn(session, "   ", image))
    assert events == [("error", "the question is empty; type a question about the image or video")]
    assert session.turns == [] and session.cache is None


def test_stream_turn_stop_ends_the_answer(adapter, image):
    session = ChatSession(adapter, dataclasses.replace(_config("blockwise-keydiff"), max_new_tokens=50))
    stop = threading.Event()
    pieces = 0
    for kind, _ in stream_turn(session, PROMPT, image, stop):
        if kind == "text":
            pieces += 1
            stop.set()
    assert session.turns[-1].stopped == "stopped" and pieces <= 2


def test_stream_turn_stop_during_prefill_ends_with_a_stopped_event(adapter, image):
    session = ChatSession(adapter, _config("blockwise-snapkv", block_size=32, prefill="blockwise"))
    stop = threading.Event()
    kinds, n_blocks = [], 0
    for kind, payload in stream_turn(session, PROMPT, image, stop):
        kinds.append(kind)
        n_blocks = n_blocks or payload.n_blocks
        stop.set()  # after the first block (the worker may have finished one more meanwhile)
    assert kinds[-1] == "stopped" and set(kinds[:-1]) == {"block"}  # no text: no answer from a stopped prefill
    assert len(kinds) - 1 < n_blocks
    assert session.turns == [] and session.cache is None


def test_retained_per_layer_averages_to_retained(snap):
    session, report, _ = snap
    per_layer = session.retained_per_layer()
    assert per_layer.shape == (session.adapter.num_layers, report["visual_tokens"])
    np.testing.assert_allclose(per_layer.mean(axis=0), report["retained"], atol=1e-3)
    # under the budget, each layer keeps at most BUDGET entries per KV head
    assert (per_layer.sum(axis=1) <= BUDGET + 1e-6).all()


def test_live_report_draws_the_blocks_so_far(snap):
    session, _, events = snap
    blocks = [p for k, p in events if k == "block"]
    fig = block_memory_figure(live_report(session, blocks[:3]), n_blocks=len(blocks))
    traces = {t.name: t for t in fig.data}
    assert len(traces["KV cache (held)"].x) == 3
    assert "full cache (so far)" in traces and "full cache" not in traces  # input length unknown until the end
    assert list(fig.layout.xaxis.range) == [0.5, len(blocks) + 0.5]


def test_method_settings_round_trip():
    keys = {s.key: s for s in method_settings("blockwise-snapkv")}
    assert keys["window"].kind == "int" and keys["window"].default == 64
    opts = method_options("blockwise-snapkv", {"window": "16", "kernel_size": 3, "nonsense": 1})
    method = METHODS["blockwise-snapkv"](**opts)
    assert method.config_dict()["window"] == 16 and method.config_dict()["kernel_size"] == 3
    assert method_settings("full") == [] and method_options("full", {"x": 1}) == {}
    with pytest.raises(ConfigError):
        method_options("blockwise-snapkv", {"window": "many"})


# -- figures ----------------------------------------------------------------------------------------


def _token_kv_bytes(adapter) -> int:
    """KV bytes of one token at full precision, from the model's config: layers x (K, V) x KV heads x head_dim x
    bytes per value (the tiny Qwen: 2 x 2 x 2 x 16 x 4 = 512)."""
    text = adapter.model.config.get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * adapter.model.dtype.itemsize


def test_block_memory_figure_one_point_per_block_with_budget_and_full_lines(snap, adapter):
    _, report, _ = snap
    token_bytes = _token_kv_bytes(adapter)
    assert token_bytes == 512 and kv_bytes_per_token(report) == token_bytes
    fig = block_memory_figure(report)
    traces = {t.name: t for t in fig.data}
    n = len(report["blocks"])
    assert n > 3
    assert len(traces["KV cache (held)"].x) == n and len(traces["process RSS"].y) == n
    budget = budget_kv_bytes(report)
    assert budget == BUDGET * token_bytes
    assert list(traces["budget"].y) == [budget / MIB] * 2
    assert list(traces["full cache"].y) == [report["full_kv_bytes"] / MIB] * 2
    growing = np.array(traces["full cache (so far)"].y)  # blockwise: every token went through the LLM
    assert len(growing) == n and (np.diff(growing) > 0).all()
    assert growing[-1] * MIB == pytest.approx(report["prompt_tokens"] * token_bytes)
    held = np.array(traces["KV cache (held)"].y)
    assert held.max() < report["full_kv_bytes"] / MIB  # compression held the cache below full
    # held, peak and budget have a panel of their own, scaled to them (not to the full cache) ...
    peak = np.array(traces["KV peak so far"].y)
    assert traces["KV peak so far"].yaxis == traces["budget"].yaxis == "y"
    top = fig.layout.yaxis.range[1]
    assert max(held.max(), peak.max(), budget / MIB) <= top < report["full_kv_bytes"] / MIB
    # ... and the full cache and the process RSS share a log axis in the other panel (no second y axis)
    assert traces["full cache"].yaxis == traces["process RSS"].yaxis == "y2" and fig.layout.yaxis2.type == "log"
    assert fig.layout.yaxis2.overlaying is None
    assert fig.layout.xaxis.tickformat == "d" and fig.layout.xaxis.dtick >= 1
    json.loads(fig.to_json())  # serialisable for gr.Plot


def budget_named_and_drawn(fig) -> tuple[bool, bool]:
    """Whether the memory chart's left panel names a budget in its title, and whether it draws a budget line."""
    title = fig.layout.annotations[0].text  # the left panel's subplot title
    return "budget" in title, any(t.name == "budget" for t in fig.data)


def test_the_memory_panel_names_the_budget_it_draws_and_none_without_one(snap, adapter):
    """A method with a budget: the panel's title names it and its line is drawn; Sali-Cache keeps no budget (it
    tiers and skips): the panel names none and draws none."""
    _, report, _ = snap
    assert budget_named_and_drawn(block_memory_figure(report)) == (True, True)
    session = ChatSession(adapter, _config("salicache"))
    session.ask(PROMPT, video_media(4, 224, 168, fps=1.0, seed=3))
    salicache = turn_report(session)
    assert salicache["method"] == "salicache" and not salicache["budget"]
    fig = block_memory_figure(salicache)
    assert budget_named_and_drawn(fig) == (False, False), fig.layout.annotations[0].text
    assert "budget" not in " ".join(str(t.name) for t in fig.data)  # no legend entry claims one either


def test_single_block_memory_figure_has_integer_ticks_and_visible_markers(snap):
    _, report, _ = snap
    one = {**report, "blocks": [{**report["blocks"][0], "n_blocks": 1}]}
    fig = block_memory_figure(one)
    assert list(fig.layout.xaxis.range) == [0.5, 1.5] and fig.layout.xaxis.dtick == 1
    assert fig.layout.xaxis.tickformat == "d"
    held = next(t for t in fig.data if t.name == "KV cache (held)")
    assert held.marker.size >= 10


def test_heatmap_is_downscaled_and_per_layer(snap, image):
    _, report, _ = snap
    big = np.asarray(Image.fromarray(image.frames[0]).resize((1792, 1344)))  # same layout, scaled pixels
    scaled = {
        **report,
        "layout": {
            **report["layout"],
            "frames": [{**f, "box": [v * 4 for v in f["box"]]} for f in report["layout"]["frames"]],
        },
    }
    heat = retained_view([big], None, scaled, max_side=400, colour_bar=False)
    assert heat.size == (400, 300)
    avg = np.asarray(retained_view(image.frames, image.times, report))
    layer0 = np.asarray(retained_view(image.frames, image.times, report, layer=0))
    assert avg.shape == layer0.shape and avg.shape[1] == 448 and avg.shape[0] > 336  # colour bar underneath
    # 448 x 336 at scale 1: token i covers the 28 x 28 px cell at (token_row, token_col) of its layout grid;
    # its pixels differ between the two views exactly where layer 0 kept a different share than the average
    layout = report["layout"]
    assert layout["frames"][0]["box"] == [0, 0, 448, 336] and layout["frames"][0]["grid"] == [12, 16]
    gap = np.abs(np.asarray(report["retained_per_layer"][0]) - np.asarray(report["retained"]))
    cell_differs = np.array(
        [
            not np.array_equal(
                avg[28 * r : 28 * r + 28, 28 * c : 28 * c + 28], layer0[28 * r : 28 * r + 28, 28 * c : 28 * c + 28]
            )
            for r, c in zip(layout["token_row"], layout["token_col"], strict=True)
        ]
    )
    assert (gap > 0.02).sum() > 0  # the layers kept different tokens: the comparison below can fail
    assert cell_differs[gap > 0.02].all() and not cell_differs[gap == 0].any()


def test_before_after_pair_has_one_size_and_the_before_side_is_the_media(snap, image):
    _, report, _ = snap
    before = np.asarray(retained_view(image.frames, image.times, report, opacity=0.0))
    faint = np.asarray(retained_view(image.frames, image.times, report, opacity=0.2))
    after = np.asarray(retained_view(image.frames, image.times, report, opacity=0.8))
    assert before.shape == after.shape  # the two sides of a slider line up
    assert np.array_equal(before[:336], image.frames[0])  # opacity 0: the image itself
    media_diff = [np.abs(x[:336].astype(int) - image.frames[0]).mean() for x in (faint, after)]
    assert 0 < media_diff[0] < media_diff[1]  # opacity sets how strongly the keep map covers the image


def test_keep_colour_map_is_sequential_and_not_red_green():
    ramp = colour_map(np.linspace(0, 1, 50, dtype=np.float32))
    luminance = ramp @ np.array([0.2126, 0.7152, 0.0722])
    assert (np.diff(luminance) > 0).all()  # readable in grey and for every colour-vision deficiency
    assert tuple(ramp[0].round()) == (68, 1, 84) and tuple(ramp[-1].round()) == (253, 231, 37)  # viridis
    red_green = np.abs(ramp[:, 0] - ramp[:, 1]) > 200
    assert not red_green.any()


def test_summary_rows_name_the_key_numbers(snap):
    _, report, _ = snap
    rows = dict(summary_rows(report))
    assert rows["method"] == "blockwise-snapkv" and rows["visual tokens"] == "192"
    assert "% of full" in rows["peak KV"]
    line = summary_line(report)
    ratio = report["full_kv_bytes"] / report["peak_kv_bytes"]
    assert line.startswith("192 visual tokens") and f"{ratio:.1f}× less at peak" in line and "TTFT" in line
    assert decode_speed({"decode_tokens_per_second": 0.0, "token_ids": [5]}) == "n/a"
    assert decode_speed({"decode_tokens_per_second": 3.0, "token_ids": [5, 6]}) == "3.0 tokens/s"
    graph = {"decode_tokens_per_second": 3.0, "token_ids": [5, 6], "decode_mode": "graph"}
    assert decode_speed(graph) == "3.0 tokens/s (CUDA graph)"
    grouped = {**graph, "decode_attention": "grouped"}
    assert decode_speed(grouped) == "3.0 tokens/s (CUDA graph, grouped attention)"
    # a block-wise prefill on this CPU: its blocks after the first attended with grouped-query SDPA
    assert rows["attention after the cache (last turn's prefill)"] == PREFILL_ATTENTION["gqa"]
    assert prefill_attention({"prefill_attention": "flash"}).startswith("flash kernel")
    assert prefill_attention({"prefill_attention": ""}).startswith("none")


def test_summary_line_quotes_two_media_warnings_and_counts_the_rest(snap):
    _, report, _ = snap
    assert "⚠️" not in summary_line(report)
    found = [f"frame {k} could not be decoded" for k in range(5)]
    line = summary_line({**report, "media": {**(report.get("media") or {}), "warnings": found}})
    assert line.endswith(
        "⚠️ frame 0 could not be decoded; frame 1 could not be decoded (+3 more in the report's media.warnings)"
    )
    # a file name is shown as it is, not as Markdown (the summary is rendered as Markdown)
    named = ["'my_scan*1*.tif' (3 pages): only the first page is read"]
    line = summary_line({**report, "media": {**(report.get("media") or {}), "warnings": named}})
    assert line.endswith("⚠️ 'my\\_scan\\*1\\*.tif' (3 pages): only the first page is read"), line


def test_views_of_absent_method_fields_are_none(snap):
    _, report, _ = snap
    assert not has_saliency(report) and not has_merge_map(report) and not is_video(report)
    frames = [np.zeros((336, 448, 3), np.uint8)]
    assert saliency_view(frames, [0.0], report) is None and tier_view(frames, [0.0], report) is None
    assert merge_view(frames, [0.0], report) is None and layer_tokens_figure(report) is None
    assert frame_timeline_figure(report) is None and frame_gallery(frames, report) is None


@pytest.mark.skipif("salicache" not in METHODS, reason="Sali-Cache is not registered")
def test_salicache_video_views(adapter):
    video = video_media(8, 224, 168, fps=1.0, seed=3)
    session = ChatSession(adapter, _config("salicache"))
    session.ask(PROMPT, video)
    report = turn_report(session)
    assert is_video(report) and has_saliency(report) and has_motion(report)
    timeline = {t.name: t for t in frame_timeline_figure(report).data}
    assert len(timeline["motion"].x) == 8 and list(timeline["threshold"].y) == [report["flow_threshold"]] * 2
    skipped = sum(f["skipped"] for f in report["frames"])
    assert len(timeline["skipped"].x) == skipped
    thumbs = frame_gallery(video.frames, report, max_side=80)
    assert len(thumbs) == 8 and all(max(img.size) == 80 for img, _ in thumbs)
    strip = retained_view(video.frames, video.times, report)
    assert strip.width < 8 * 250  # one small tile per temporal patch, not full frames
    tiers = tier_view(video.frames, video.times, report)
    assert tiers.height > strip.height  # legend underneath
    assert saliency_view(video.frames, video.times, report) is not None
    n_frames = len(report["layout"]["frames"])
    for gallery in (
        saliency_gallery(video.frames, video.times, report),
        tier_gallery(video.frames, video.times, report),
    ):
        assert len(gallery) == n_frames  # one image per frame
        # the frame at its own size with nothing drawn under it: the page shows the colours' legend once, as
        # text, since text drawn into images shown a few to a row would be too small to read
        assert all(img.size == (224, 168) and caption.startswith("frame ") for img, caption in gallery)
    per_frame = [caption for _, caption in tier_gallery(video.frames, video.times, report)]
    total = sum(int(part.rsplit(" ", 1)[1]) for c in per_frame for part in c.split(" · ")[2].split(", "))
    assert total == len(report["tier"])  # the per-frame counts add up to every token
    assert "video frames sampled / skipped" in dict(summary_rows(report))
    # pruned tokens never reach the LLM, so "tokens read" is not the uncompressed cache: no growing line
    names = [t.name for t in block_memory_figure(report).data]
    assert report["tiers"]["pruned"] > 0 and "full cache (so far)" not in names and "full cache" in names


@pytest.mark.skipif("lightkv" not in METHODS, reason="LightKV is not registered")
def test_lightkv_merge_views(adapter, image):
    session = ChatSession(adapter, _config("lightkv"))
    session.ask(PROMPT, image)
    report = turn_report(session)
    assert has_merge_map(report)
    merge = merge_view(image.frames, image.times, report)
    assert merge.width == 448 and merge.height > 336
    fig = layer_tokens_figure(report)
    assert len(fig.data[0].x) == session.adapter.num_layers
    assert fig.layout.xaxis.tickformat == "d" and fig.layout.xaxis.dtick >= 1
    # every colour of the legend is one the drawing uses (blended 55 % over the image)
    drawn = np.asarray(merge)[:336].reshape(-1, 3).astype(int)
    base = np.asarray(image.frames[0]).reshape(-1, 3).astype(int)
    legend = merge_legend(report)
    assert legend[0][2] > 0 and sum(count for _, _, count in legend[1:]) > 0
    for label, colour, count in legend:
        if count:
            expected = 0.45 * base + 0.55 * np.array(colour)
            assert (np.abs(drawn - expected).max(axis=1) <= 1).any(), label


def test_tier_names_accept_codes_and_names():
    assert [tier_name(t) for t in (0, 1, 2, 3, 4)] == ["full", "int8", "int4", "pruned", "skipped"]
    assert tier_name("FP16") == "full" and tier_name(1, ["a", "b"]) == "b"


def test_compare_methods_table_and_curves(adapter, image):
    methods = ["blockwise-keydiff", "full", "no-such-method"]
    with pytest.raises(ConfigError):
        list(compare_methods(adapter, image, PROMPT, methods, _config("full")))
    results = dict(
        compare_methods(
            adapter, image, PROMPT, ["blockwise-keydiff", "full"], dataclasses.replace(_config("full"), budget=BUDGET)
        )
    )
    assert list(results) == ["full", "blockwise-keydiff"]  # the reference runs first
    rows = compare_rows(results)
    assert [r[0] for r in rows] == ["full", "blockwise-keydiff"]
    assert rows[0][COMPARE_HEADERS.index("agreement with full")] == "100%"
    assert rows[0][: COMPARE_HEADERS.index("peak vs full") + 1] == ["full", "100%", "100.0%"]
    peak = COMPARE_HEADERS.index("peak MiB")
    assert rows[1][peak] < rows[0][peak]  # peak KV under the budget is below the full cache's
    fig = compare_memory_figure(results)
    curves = [t for t in fig.data if t.type == "scatter"]
    assert [t.name for t in curves] == ["full", "blockwise-keydiff"]
    styles = [(t.line.color, t.line.dash) for t in curves]
    assert len(set(styles)) == len(styles) and all(len(set(parts)) == 2 for parts in zip(*styles))
    assert curves[0].line.width > curves[1].line.width  # the one drawn first stays visible under the next
    # one row of bars per method: its peak and what it held at the end, each in its own place
    bars = {(t.y[0], t.marker.opacity): t.x[0] for t in fig.data if t.type == "bar"}
    for name in ("full", "blockwise-keydiff"):
        assert bars[(name, 0.35)] == pytest.approx(results[name]["peak_kv_bytes"] / MIB)
        assert bars[(name, 1.0)] == pytest.approx(results[name]["final_kv_bytes"] / MIB)
    assert agreement([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3) and agreement([], []) == 1.0


@pytest.mark.parametrize(("seconds_per_block", "seconds_per_draw"), [(0.0, 0.0), (0.0, 0.3), (0.3, 0.0)])
def test_live_block_updates_keep_the_page_up_with_the_engine(snap, monkeypatch, seconds_per_block, seconds_per_draw):
    """Blocks faster than a page can draw (a small model: ~30 ms each) are drawn at most 4 a second, the
    first and the last always, the skipped ones in the next chart; blocks slower than that are each drawn.
    A draw slower than the interval (a loaded machine) does not make every block due: the interval counts
    from the end of the last update."""
    import time
    from types import SimpleNamespace

    from ui import chat
    from ui.callbacks import Callbacks
    from ui.state import ModelCache
    from visualkv.report import viz  # the module through which the ui looks the figure up

    draw = block_memory_figure

    def slow_draw(*args, **kwargs):
        time.sleep(seconds_per_draw)
        return draw(*args, **kwargs)

    monkeypatch.setattr(viz, "block_memory_figure", slow_draw)

    block = next(p for kind, p in snap[2] if kind == "block")
    n_blocks = 40 if seconds_per_block == 0 else 3

    def replay(session, prompt, media, stop, time_limit=None):  # stands in for the engine's stream
        for i in range(n_blocks):
            time.sleep(seconds_per_block)
            yield "block", dataclasses.replace(block, index=i, n_blocks=n_blocks)
        yield "stopped", "stopped"

    monkeypatch.setattr(chat, "stream_turn", replay)
    h = Callbacks.create(ModelCache(device="cpu"), "tiny-qwen2.5-vl")
    request = SimpleNamespace(session_hash="alice")
    turn = h.turns.chat(
        request, {"text": "hi", "files": []}, None, "full", 1024, 10, 0, 4, 0.0, "reuse", "auto", 1, 1.0, 8
    )
    drawn = [(out[4], out[5]) for out in turn if "prefill block" in str(out[4])]
    labels = [re.search(r"prefill block (\d+)/", progress).group(1) for progress, _ in drawn]
    if seconds_per_block == 0:
        assert labels == ["1", str(n_blocks)], labels
    else:
        assert labels == [str(i + 1) for i in range(n_blocks)], labels
    held = next(t for t in drawn[-1][1].data if t.name == "KV cache (held)")
    assert len(held.x) == n_blocks  # the last chart has every block, drawn or skipped


# -- an hour of video ------------------------------------------------------------------------------


def _hour_report(motion: bool) -> dict:
    """3,600 sampled frames at 1 fps with runs of skipped frames of every length (1 to 40 frames)."""
    rng = np.random.default_rng(7)
    skipped, k = np.zeros(3600, dtype=bool), 0
    while k < 3600:
        run = int(rng.integers(1, 41))
        skipped[k : k + run] = rng.random() < 0.4
        k += run
    frames = [{"time": float(t), "skipped": bool(s)} for t, s in enumerate(skipped)]
    if motion:
        for f in frames:
            f["motion"] = float(rng.random() * 3)
    return {"frames": frames, "flow_threshold": 1.0 if motion else None}


@pytest.mark.parametrize("motion", [True, False])
def test_hour_long_timeline_is_binned_zoomable_and_shades_exactly_the_skipped_frames(motion):
    report = _hour_report(motion)
    fig = frame_timeline_figure(report)
    # legible and cheap: a handful of traces, no layout shapes, at most ~200 bins per series
    assert len(fig.data) <= 6 and len(fig.layout.shapes) == 0
    series = [t for t in fig.data if t.name != "skipped spans"]
    assert all(len(t.x) <= 201 for t in series), [(t.name, len(t.x)) for t in series]
    assert fig.layout.xaxis.rangeslider.visible  # zoom on the time axis
    if not motion:  # every frame is in one bin, kept or skipped
        per_bin = {t.name: sum(t.y) for t in series}
        assert per_bin == {
            "kept frames per bin": 3600 - sum(f["skipped"] for f in report["frames"]),
            "skipped frames per bin": sum(f["skipped"] for f in report["frames"]),
        }
    # the shading: rectangles [a, b) read back from the one filled trace
    shade = next(t for t in fig.data if t.name == "skipped spans")
    xs = list(shade.x)
    rects = [(xs[i], xs[i + 2]) for i in range(0, len(xs), 6)]
    assert rects == skipped_spans(report)
    times = np.array([f["time"] for f in report["frames"]])
    skipped = np.array([f["skipped"] for f in report["frames"]])
    inside = np.zeros(len(times), dtype=bool)
    for a, b in rects:
        inside |= (times >= a) & (times < b)
    assert (inside == skipped).all()  # every skipped time shaded, no kept time shaded
    runs = int(np.sum(np.diff(np.concatenate([[0], skipped.astype(int)])) == 1))
    assert len(rects) == runs  # one rectangle per run of skipped frames, not one per frame


def test_a_short_video_keeps_one_bar_per_frame():
    report = _hour_report(True)
    report["frames"] = report["frames"][:100]
    names = {t.name: len(t.x) for t in frame_timeline_figure(report).data}
    assert names["motion"] == 100 and names["skipped"] == sum(f["skipped"] for f in report["frames"])


def test_blocks_say_how_far_into_the_video_the_prefill_has_read(adapter):
    video = video_media(8, 112, 84, fps=1.0, seed=2)
    session = ChatSession(adapter, _config("blockwise-keydiff", block_size=12, prefill="blockwise"))
    blocks = [p for kind, p in stream_turn(session, PROMPT, video) if kind == "block"]
    seconds = [b.media_seconds for b in blocks]
    visual = [s for b, s in zip(blocks, seconds) if b.visual_tokens_in]
    assert len(visual) >= 3 and all(s is not None for s in visual)
    assert visual == sorted(visual) and len(set(visual)) >= 3  # moves forward block by block
    last_frame = max(f.time for f in session.prepared.layout.frames)
    assert seconds[-1] == last_frame  # the whole video read by the end
    fig = block_memory_figure(turn_report(session), media_duration=video.duration)
    said = [a.text for a in fig.layout.annotations if a.name == VIDEO_READ]
    assert said == [f"video: 0:{round(last_frame):02d} of 0:08 read"]  # once, over both panels
    assert fig.layout.xaxis.title.text == fig.layout.xaxis2.title.text == "prefill block"
    assert any("of 0:08 read" in (h or "") for h in fig.data[0].hovertext)
    image_blocks = [
        p
        for kind, p in stream_turn(
            ChatSession(adapter, _config("blockwise-keydiff")), PROMPT, image_media(112, 84, seed=1)
        )
        if kind == "block"
    ]
    assert all(b.media_seconds is None for b in image_blocks)


class _CountingFrames:
    """A frame sequence that records which frames were read (a lazily decoded video stands in)."""

    def __init__(self, frames):
        self._frames, self.read = frames, set()

    def __len__(self):
        return len(self._frames)

    def __getitem__(self, i):
        self.read.add(i)
        return self._frames[i]

    def __iter__(self):
        raise AssertionError("a view iterated over every frame")


def test_frame_gallery_captions_and_borders_say_kept_or_skipped():
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (90, 160, 3), dtype=np.uint8) for _ in range(6)]
    report = {"frames": [{"time": 2.0 * i, "skipped": i in (1, 2, 5)} for i in range(6)]}
    items = frame_gallery(frames, report, max_side=64)
    assert [caption for _, caption in items] == [
        "0.0 s · kept",
        "2.0 s · skipped",
        "4.0 s · skipped",
        "6.0 s · kept",
        "8.0 s · kept",
        "10.0 s · skipped",
    ]
    assert all(img.size == (64, 36) for img, _ in items)
    skipped = [f["skipped"] for f in report["frames"]]
    # the border says the same: vermillion round the skipped frames, blue round the kept ones
    assert [img.getpixel((0, 0)) for img, _ in items] == [SKIPPED_COLOUR if s else KEPT_COLOUR for s in skipped]
    # skipped frames are dimmed (blended towards white), kept ones shown as they are
    centre = [np.asarray(img)[10:26, 10:54].mean() for img, _ in items]
    plain = [
        np.asarray(Image.fromarray(f).resize((64, 36), Image.Resampling.BILINEAR))[10:26, 10:54].mean() for f in frames
    ]
    assert all((c > p + 40) if s else abs(c - p) < 1e-6 for c, p, s in zip(centre, plain, skipped))


def test_long_video_views_read_only_the_frames_they_draw(adapter):
    video = video_media(64, 56, 56, fps=1.0, seed=4)
    session = ChatSession(adapter, _config("blockwise-keydiff"))
    session.ask(PROMPT, video)
    report = turn_report(session)
    n_layout = len(report["layout"]["frames"])
    assert n_layout > MAX_FRAMES_SHOWN
    frames = _CountingFrames(video.frames)
    strip = retained_view(frames, video.times, report)
    assert 0 < len(frames.read) <= MAX_FRAMES_SHOWN and strip.width > 0
    thumbs = _CountingFrames(video.frames)
    assert len(frame_gallery(thumbs, report)) == MAX_FRAMES_SHOWN
    assert len(thumbs.read) <= MAX_FRAMES_SHOWN
    assert shown_frames(3600)[0] == 0 and shown_frames(3600)[-1] == 3599


def _ink(img: Image.Image, box: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """(left, top, right, bottom) of the dark pixels (text) inside `box` of an image on white, or None."""
    dark = (np.asarray(img.crop(box).convert("L")) < 128).nonzero()
    if not len(dark[0]):
        return None
    return (
        box[0] + int(dark[1].min()),
        box[1] + int(dark[0].min()),
        box[0] + int(dark[1].max()),
        box[1] + int(dark[0].max()),
    )


@pytest.mark.parametrize("width", [420, 960, 1920])
def test_text_drawn_into_views_stays_legible_at_the_panel_width(width):
    """Legends, colour-bar titles and captions are drawn into the images, which the app shrinks to its panel
    (`SHOWN_WIDTH_PX`): their glyphs must still be `MIN_SHOWN_TEXT_PX` high there (a fixed 14-px font under a
    1920-px view would be 3 px on screen)."""
    shown = SHOWN_WIDTH_PX / width
    body = Image.new("RGB", (width, 40), "white")
    legend = with_legend(body, [("merged into a neighbour", (255, 230, 0), 5262)])
    _, top, _, bottom = _ink(legend, (text_unit(width) + 10, 40, legend.width, legend.height))
    assert (bottom - top + 1) * shown >= MIN_SHOWN_TEXT_PX
    bar = with_colour_bar(body, KEEP_CMAP, "share kept")
    title = _ink(bar, (0, 40, bar.width, 40 + text_unit(width) + 4))
    assert (title[3] - title[1] + 1) * shown >= MIN_SHOWN_TEXT_PX
    # a sheet of 8 tiles a row: captions as high, and each inside its own tile even when too long for it
    tiles = [Image.new("RGB", (width // 8 - 4, 30), "white")] * 8
    long = ["t=1234.5s · a caption far wider than its tile"] * 8
    for captions in (["t=12.0s"] * 8, long):
        sheet = grid(tiles, captions)
        step = tiles[0].width + 4
        inks = [_ink(sheet, (4 + k * step, 34, 4 + k * step + tiles[0].width, sheet.height)) for k in range(8)]
        assert all(ink is not None for ink in inks)
        gaps = [
            _ink(sheet, (4 + k * step + tiles[0].width, 34, 4 + (k + 1) * step + 2, sheet.height)) for k in range(7)
        ]
        assert gaps == [None] * 7  # no caption runs into the next one
        if captions[0] == "t=12.0s":
            assert all((ink[3] - ink[1] + 1) * shown >= MIN_SHOWN_TEXT_PX for ink in inks)


def _memory_report(kv_mib: list[float], rss_mib: list[float], full_mib: float) -> dict:
    """A report of a few prefill blocks with the given held KV and process RSS (MiB)."""
    blocks = [
        {"kv_bytes": kv * MIB, "peak_kv_bytes": kv * MIB, "rss_bytes": rss * MIB, "tokens_in": 100, "n_blocks": 3}
        for kv, rss in zip(kv_mib, rss_mib)
    ]
    return {"blocks": blocks, "full_kv_bytes": full_mib * MIB}


@pytest.mark.parametrize(
    ("kv", "rss", "full"),
    [([120, 180, 240], [900, 1100, 1300], 600), ([0.4, 0.5, 0.5], [1000, 1100, 1150], 2.5), ([3, 4, 5], [6, 7, 8], 9)],
)
def test_the_memory_charts_log_axis_reads_as_plain_growing_numbers(kv, rss, full):
    """Right panel (log MiB): every tick label is a plain number and they grow upwards ("1, 10, 100, 1,000"), never
    Plotly's bare minor digits between powers of ten ("100, 2, 5, 1000")."""
    axis = block_memory_figure(_memory_report(kv, rss, full)).layout.yaxis2
    assert axis.type == "log" and axis.tickvals and len(axis.tickvals) >= 3, axis
    labels = list(axis.ticktext)
    assert all(re.fullmatch(r"\d{1,3}(,\d{3})*(\.\d+)?", t) for t in labels), labels
    values = [float(t.replace(",", "")) for t in labels]
    assert values == sorted(values) and len(set(values)) == len(values), labels
    assert values == pytest.approx(list(axis.tickvals)), (labels, axis.tickvals)  # each label is its tick's value
    low, high = 10 ** axis.range[0], 10 ** axis.range[1]
    assert low <= min([*kv, *rss, full]) and max([*kv, *rss, full]) <= high  # every point inside the axis


@pytest.mark.parametrize(
    ("skipped", "encoded", "expected"),
    [
        (
            20,
            6,
            (
                "32 frames sampled: 20 skipped as nearly unchanged, 12 kept; "
                "the vision encoder read the 12 kept frames as 6 inputs of 2 frames"
            ),
        ),
        (0, 16, "32 frames sampled, none skipped; the vision encoder read the 32 frames as 16 inputs of 2 frames"),
        (
            4,
            28,
            (
                "32 frames sampled: 4 skipped as nearly unchanged, 28 kept; "
                "the vision encoder read the 28 kept frames, one input each"
            ),
        ),
    ],
)
def test_the_frames_sentence_shows_its_arithmetic(skipped, encoded, expected):
    from visualkv.report.timeline import frames_sentence

    report = {
        "frames": [{"time": float(i), "skipped": i < skipped} for i in range(32)],
        "vision_encoder_frames": encoded,
    }
    assert frames_sentence(report) == expected
    title = frame_timeline_figure(report).layout.title.text
    assert expected.replace("; ", "<br>") in title  # on two lines over the timeline


def test_the_keep_maps_colour_bar_names_the_layer_it_shows():
    from visualkv.report.overlays import keep_bar_title

    assert "over layers" in keep_bar_title(None)
    assert "in layer 3" in keep_bar_title(3) and "over layers" not in keep_bar_title(3)
