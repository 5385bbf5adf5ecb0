"""The figures and overlays of a report, under one name for the app and the CLI (no gradio import).

Each lives in a module of its own job: memory_chart, overlays, frames, timeline, lightkv_views, tables,
compare, palette, drawing, tokens, applicable, save. Everything reads a report dict (see
`ChatSession.report`) or benchmark rows, so the app, the CLI and the benches draw the same numbers.
"""

from __future__ import annotations

from visualkv.report.applicable import has_merge_map, has_motion, has_saliency, is_video
from visualkv.report.clock import clock, video_read
from visualkv.report.compare import (
    COMPARE_HEADERS,
    agreement,
    compare_headers,
    compare_memory_figure,
    compare_rows,
    compare_widths,
    has_evidence_column,
)
from visualkv.report.evidence_view import evidence_recall_text, evidence_view, has_evidence, recall_bucket
from visualkv.report.frames import MAX_FRAMES_SHOWN, frame_gallery, shown_frames
from visualkv.report.lightkv_views import layer_tokens_figure, merge_legend, merge_view
from visualkv.report.memory_chart import (
    MIB,
    VIDEO_READ,
    block_memory_figure,
    budget_kv_bytes,
    kv_bytes_per_token,
    memory_sweep_figure,
)
from visualkv.report.overlays import (
    SALIENCY_SCALE,
    retained_view,
    saliency_gallery,
    saliency_view,
    tier_gallery,
    tier_view,
)
from visualkv.report.palette import (
    KEPT_COLOUR,
    SALIENCY_CMAP,
    SKIPPED_COLOUR,
    TIERS,
    colour_map,
    colour_stops,
    hex_colour,
    tier_name,
)
from visualkv.report.save import save_figure
from visualkv.report.tables import (
    PREFILL_ATTENTION,
    decode_speed,
    md_literal,
    prefill_attention,
    summary_line,
    summary_rows,
)
from visualkv.report.timeline import TIMELINE_MAX_FRAMES, frame_timeline_figure, frames_sentence, skipped_spans

__all__ = [
    "COMPARE_HEADERS",
    "KEPT_COLOUR",
    "MAX_FRAMES_SHOWN",
    "MIB",
    "PREFILL_ATTENTION",
    "SALIENCY_CMAP",
    "SALIENCY_SCALE",
    "SKIPPED_COLOUR",
    "TIERS",
    "TIMELINE_MAX_FRAMES",
    "VIDEO_READ",
    "agreement",
    "block_memory_figure",
    "budget_kv_bytes",
    "clock",
    "colour_map",
    "colour_stops",
    "compare_headers",
    "compare_memory_figure",
    "compare_rows",
    "compare_widths",
    "decode_speed",
    "evidence_recall_text",
    "evidence_view",
    "frame_gallery",
    "frame_timeline_figure",
    "frames_sentence",
    "has_evidence",
    "has_evidence_column",
    "has_merge_map",
    "has_motion",
    "has_saliency",
    "hex_colour",
    "is_video",
    "kv_bytes_per_token",
    "layer_tokens_figure",
    "md_literal",
    "memory_sweep_figure",
    "merge_legend",
    "merge_view",
    "prefill_attention",
    "recall_bucket",
    "retained_view",
    "saliency_gallery",
    "saliency_view",
    "save_figure",
    "shown_frames",
    "skipped_spans",
    "summary_line",
    "summary_rows",
    "tier_gallery",
    "tier_name",
    "tier_view",
    "video_read",
]
