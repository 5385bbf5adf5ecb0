"""The result tabs after a turn: kept tokens, saliency, frames, merges and numbers, all drawn by `visualkv.report.viz`.

The views read a few evenly spaced frames (only `len()` and `frames[i]`): a lazily decoded hour of video is
never materialised here.
"""

from __future__ import annotations

import html

import gradio as gr

from visualkv.report import viz

from . import text
from .state import UserState

NOT_AVAILABLE = "_Not available for this method._"


def empty_views() -> tuple:
    """The result tabs of a chat without a turn (outputs: `ResultViews.outputs`)."""
    return (
        gr.update(choices=["average"], value="average"),
        text.EMPTY_HEAT_NOTE,
        None,
        "Sali-Cache only.",
        "",
        None,
        "",
        None,
        "Video only.",
        None,
        None,
        "LightKV only.",
        None,
        None,
        "No turn yet.",
    )


def views(state, layer_choice, opacity=0.6):
    """Every result tab for the chat's last report (outputs: `ResultViews.outputs`)."""
    if state is None or state.report is None or state.session is None:
        return empty_views()
    rep, media = state.report, state.session.media
    frames = media.frames if media is not None else []
    times = media.times if media is not None else None
    n_layers = len(rep.get("retained_per_layer") or [])
    layers = ["average", *(f"layer {i}" for i in range(n_layers))]
    layer_value = layer_choice if layer_choice in layers else "average"
    sampled = _sampled_note(rep)
    has_frames = len(frames) > 0
    heat_note, heat = _kept_tokens(state, rep, has_frames, layer_value, opacity, sampled)
    return (
        gr.update(choices=layers, value=layer_value),
        heat_note,
        heat,
        *_saliency(rep, frames, times, has_frames, sampled),
        *_frames(rep, frames),
        *_merges(rep, frames, times, has_frames),
        "| quantity | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in viz.summary_rows(rep)),
    )


def layer_changed(state, layer_choice, opacity=0.6):
    """A new layer or opacity: the note (which layer it tells of) and the before/after slider redrawn
    (outputs: heat note, slider)."""
    if state is None or state.report is None or state.session is None or state.session.media is None:
        return gr.skip(), gr.skip()
    rep = state.report
    if not rep.get("visual_tokens"):
        return gr.skip(), gr.skip()
    return _kept_tokens(state, rep, True, layer_choice, opacity, _sampled_note(rep))


def _sampled_note(rep: dict) -> str:
    """ " A long video: 24 of its 600 frames are drawn, evenly spaced." (or "")."""
    n_layout = len((rep.get("layout") or {}).get("frames") or [])
    if viz.is_video(rep) and n_layout > viz.MAX_FRAMES_SHOWN:
        return f" A long video: {viz.MAX_FRAMES_SHOWN} of its {n_layout} frames are drawn, evenly spaced."
    return ""


def before_after(st: UserState, layer_choice, opacity):
    """(media alone, keep map over it): the two sides of the before/after slider."""
    media = st.session.media
    layer = layer_index(layer_choice)
    alpha = min(max(float(opacity if opacity is not None else 0.6), 0.0), 1.0)
    return (
        viz.retained_view(media.frames, media.times, st.report, layer=layer, opacity=0.0),
        viz.retained_view(media.frames, media.times, st.report, layer=layer, opacity=alpha),
    )


def _kept_tokens(st: UserState, rep: dict, has_frames: bool, layer_value: str, opacity, sampled: str):
    """The Kept tokens tab: (note, before/after pair or None)."""
    if not (has_frames and rep.get("visual_tokens")):
        return "No image or video in this chat.", None
    heat = before_after(st, layer_value, opacity)
    layer = layer_index(layer_value)
    per_layer = rep.get("retained_per_layer") or []
    if layer is not None and layer < len(per_layer):
        kept, where = sum(per_layer[layer]) / max(rep["visual_tokens"], 1), f"in layer {layer} (over its KV heads)"
    else:
        kept, where = sum(rep.get("retained") or []) / max(rep["visual_tokens"], 1), "on average over all layers"
    note = (
        f"{rep['visual_tokens']} visual tokens, {kept:.1%} of their entries kept {where}. "
        "Left of the slider the media, right the keep map (yellow kept, dark purple evicted"
        + ("; one tile per frame)." if viz.is_video(rep) else ").")
        + sampled
    )
    return note, heat


def _saliency(rep: dict, frames, times, has_frames: bool, sampled: str):
    """The Saliency tab: (note, saliency gallery, tier gallery)."""
    if not (has_frames and viz.has_saliency(rep)):
        return NOT_AVAILABLE + " Saliency and tiers come from Sali-Cache.", "", None, "", None
    note = (
        "Saliency (bright = salient) and the precision tier of each visual token, one image per "
        "frame: click one to zoom." + sampled
    )
    saliency, tiers = viz.saliency_gallery(frames, times, rep), viz.tier_gallery(frames, times, rep)
    return note, saliency_legend_html(), saliency, tier_legend_html(), tiers


def saliency_legend_html() -> str:
    """The saliency colour scale, once above its gallery, as page text (drawn into every image it would be
    too small to read at the gallery's width)."""
    stops = ", ".join(viz.colour_stops(viz.SALIENCY_CMAP))
    return (
        f'<div class="vkv-legend" title="{viz.SALIENCY_SCALE}"><span>saliency: 0 (background)</span>'
        f'<span class="vkv-ramp" style="background: linear-gradient(to right, {stops})"></span>'
        "<span>1 (most salient)</span></div>"
    )


def tier_legend_html() -> str:
    """The precision tiers' colours, once above their gallery (each frame's counts are in its caption)."""
    items = "".join(
        f'<span><span class="vkv-swatch" style="background: {viz.hex_colour(colour)}"></span>{html.escape(label)}</span>'
        for _, label, colour in viz.TIERS
    )
    return f'<div class="vkv-legend"><span>tiers:</span>{items}</div>'


def _frames(rep: dict, frames):
    """The Frames tab: (note, timeline figure, frame gallery)."""
    if not rep.get("frames"):
        return NOT_AVAILABLE + " The timeline is for videos.", None, None
    timeline, thumbs = viz.frame_timeline_figure(rep), viz.frame_gallery(frames, rep)
    note = (
        "Motion per sampled frame, the skip threshold, and skipped frames (shaded)."
        if viz.has_motion(rep)
        else "Sampled frames (skipped spans shaded; without motion scores for this method)."
    )
    if len(rep["frames"]) > viz.TIMELINE_MAX_FRAMES:
        note += (
            f" {len(rep['frames'])} frames, grouped in bins: drag on the chart or use the range slider "
            "under it to zoom into a stretch of the video (double-click to zoom out)."
        )
    return note, timeline, thumbs


def _merges(rep: dict, frames, times, has_frames: bool):
    """The Merges tab: (note, merge map, tokens-per-layer figure)."""
    if not viz.has_merge_map(rep):
        return NOT_AVAILABLE + " Merge maps come from LightKV.", None, None
    merge = viz.merge_view(frames, times, rep) if has_frames else None
    note = (
        "Dark: merged into a neighbour. Yellow to red: a kept token that now stands for 2 up to the most "
        "tokens (see the legend). Untouched tokens are shown as they are."
    )
    return note, merge, viz.layer_tokens_figure(rep)


def layer_index(choice: str | None) -> int | None:
    """The layer a selector's choice names ("layer 3" -> 3); None for "average" or nothing."""
    if not choice or choice == "average":
        return None
    try:
        return int(choice.split()[-1])
    except ValueError:
        return None
