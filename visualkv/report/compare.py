"""Comparing methods on one input: token agreement with `full`, the table rows, and KV against tokens read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from visualkv.report.memory_chart import MIB
from visualkv.report.telemetry import CUT_SHORT


def agreement(ids: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of answer positions where two token sequences agree (over the longer one)."""
    n = max(len(ids), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(ids, reference)) / n


#: what a reader compares first comes first; short headers that break only between words, so the table fits the
#: app's panel (about 540 px at 1440x900) without scrolling sideways, the answer wrapping in the last column
COMPARE_HEADERS = [
    "method",
    "agreement with full",
    "peak vs full",
    "peak MiB",
    "final MiB",
    "TTFT s",
    "answer",
]
COMPARE_COLUMN_WIDTHS = ["19%", "17%", "11%", "10%", "10%", "9%", "24%"]
#: the same with the evidence recall column (before the answer)
EVIDENCE_COLUMN_WIDTHS = ["17%", "14%", "10%", "9%", "9%", "8%", "11%", "22%"]


#: the column Compare adds when its evidence recall was asked for (before the answer)
EVIDENCE_HEADER = "evidence recall"


def has_evidence_column(results: dict[str, dict[str, Any] | str]) -> bool:
    return any(isinstance(rep, dict) and rep.get("evidence_recall") is not None for rep in results.values())


def compare_widths(results: dict[str, dict[str, Any] | str]) -> list[str]:
    return EVIDENCE_COLUMN_WIDTHS if has_evidence_column(results) else COMPARE_COLUMN_WIDTHS


def compare_headers(results: dict[str, dict[str, Any] | str]) -> list[str]:
    """COMPARE_HEADERS, with EVIDENCE_HEADER before the answer when a result carries evidence recall."""
    if not has_evidence_column(results):
        return list(COMPARE_HEADERS)
    return [*COMPARE_HEADERS[:-1], EVIDENCE_HEADER, COMPARE_HEADERS[-1]]


def compare_rows(results: dict[str, dict[str, Any] | str]) -> list[list[Any]]:
    """Table rows (`compare_headers`) for {method: report or error message}.

    Agreement is token-level against the `full` method's answer to the same question
    (1.0 = the same tokens); "n/a" when `full` is not among the results; "stopped" for an answer cut short
    (by Stop or a time limit: its tokens are a prefix, not an answer to agree with), and the answer says so.
    """
    evidence = has_evidence_column(results)
    ref = results.get("full")
    ref_ids = ref["turns"][0]["token_ids"] if isinstance(ref, dict) and ref.get("turns") else None
    rows: list[list[Any]] = []
    for name, rep in results.items():
        if isinstance(rep, str):
            rows.append([name, "", "", None, None, None, *([""] if evidence else []), f"error: {rep}"])
            continue
        turn = rep["turns"][0] if rep.get("turns") else {}
        full = rep.get("full_kv_bytes") or 0
        agree = f"{agreement(turn.get('token_ids', []), ref_ids):.0%}" if ref_ids is not None else "n/a"
        answer = turn.get("answer", "")
        if turn.get("stopped") in CUT_SHORT:
            agree, answer = "stopped", f"{answer} … (stopped after {len(turn.get('token_ids', []))} token(s))"
        rows.append(
            [
                name,
                agree,
                f"{rep['peak_kv_bytes'] / full:.1%}" if full else "",
                round(rep["peak_kv_bytes"] / MIB, 3),
                round(rep["final_kv_bytes"] / MIB, 3),
                round(turn.get("ttft_seconds", 0.0), 3),
                answer,
            ]
        )
        if evidence:
            recall = rep.get("evidence_recall")
            rows[-1].insert(-1, f"{recall:.1%}" if recall is not None else "")
    return rows


def compare_memory_figure(results: dict[str, dict[str, Any] | str]) -> go.Figure:
    """Two panels, one colour per method. Top: KV MiB held after each block against tokens read (methods block
    their input differently, so tokens read is the common x axis), lines from the origin. Bottom: one row per
    method, its peak (light bar: a transient such as post-snapkv's full-size prefill shows here at full size) and
    what it held at the end (dark bar inside it). Each method has a place of its own there: no mark hides another.
    A method's traces share its name (one legend entry)."""
    drawn = [(name, rep) for name, rep in results.items() if not isinstance(rep, str) and rep.get("blocks")]
    fig = make_subplots(
        rows=2,
        cols=1,
        row_heights=[0.58, 0.42],
        vertical_spacing=0.24,
        subplot_titles=("held after each block", "MiB at the peak (light) and at the end (dark)"),
    )
    for k, (name, rep) in enumerate(drawn):
        colour = _PALETTE[k % len(_PALETTE)]
        # earlier traces are drawn wider and under later ones: where two curves coincide (post-snapkv's line
        # meets the block-wise ones at its one block) both stay visible, each in its own colour and dash
        width = 2 + 2.5 * (len(drawn) - 1 - k) / max(len(drawn) - 1, 1)
        blocks = rep["blocks"]
        fig.add_trace(
            go.Scatter(
                x=[0, *np.cumsum([b["tokens_in"] for b in blocks]).tolist()],
                y=[0.0, *(b["kv_bytes"] / MIB for b in blocks)],
                mode="lines",
                name=name,
                legendgroup=name,
                line={"color": colour, "dash": _DASHES[k % len(_DASHES)], "width": width},
                hovertemplate="%{y:.3f} MiB after %{x} tokens<extra>%{fullData.name}</extra>",
            ),
            row=1,
            col=1,
        )
        for value, opacity, bar_width in ((rep["peak_kv_bytes"], 0.35, 0.8), (rep["final_kv_bytes"], 1.0, 0.4)):
            fig.add_trace(
                go.Bar(
                    x=[value / MIB],
                    y=[name],
                    orientation="h",
                    name=name,
                    legendgroup=name,
                    showlegend=False,
                    width=bar_width,
                    marker={"color": colour, "opacity": opacity},
                    hovertemplate="%{x:.3f} MiB<extra>%{y}</extra>",
                ),
                row=2,
                col=1,
            )
    fig.update_layout(
        barmode="overlay",
        height=320 + 30 * len(drawn),
        margin={"l": 50, "r": 10, "t": 56, "b": 80},  # the subplot title clear of the app's label
        legend={"orientation": "h", "y": -0.07, "yanchor": "top"},
    )
    fig.update_xaxes(title_text="tokens read", tickformat="d", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="KV MiB", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(rangemode="tozero", row=2, col=1)  # its unit is in its title: the legend sits under it
    fig.update_yaxes(autorange="reversed", automargin=True, row=2, col=1)  # the methods top down, as in the table
    return fig


_PALETTE = ("#000000", "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
