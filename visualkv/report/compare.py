"""Comparing methods on one input: token agreement with `full`, the table rows, and KV against tokens read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from visualkv.report.memory_chart import MIB
from visualkv.report.telemetry import CUT_SHORT


def agreement(ids: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of answer positions where two token sequences agree (over the longer one)."""
    n = max(len(ids), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(ids, reference)) / n


#: what a reader compares first comes first: the app's panel shows about five columns before it scrolls sideways
COMPARE_HEADERS = [
    "method",
    "agreement with full",
    "peak vs full",
    "peak KV (MiB)",
    "final KV (MiB)",
    "TTFT (s)",
    "answer",
]


def compare_rows(results: dict[str, dict[str, Any] | str]) -> list[list[Any]]:
    """Table rows (COMPARE_HEADERS) for {method: report or error message}.

    Agreement is token-level against the `full` method's answer to the same question
    (1.0 = the same tokens); "n/a" when `full` is not among the results; "stopped" for an answer cut short
    (by Stop or a time limit: its tokens are a prefix, not an answer to agree with), and the answer says so.
    """
    ref = results.get("full")
    ref_ids = ref["turns"][0]["token_ids"] if isinstance(ref, dict) and ref.get("turns") else None
    rows: list[list[Any]] = []
    for name, rep in results.items():
        if isinstance(rep, str):
            rows.append([name, "", "", None, None, None, f"error: {rep}"])
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
    return rows


def compare_memory_figure(results: dict[str, dict[str, Any] | str]) -> go.Figure:
    """KV MiB against tokens read, one curve per method (methods block their input differently,
    so tokens read is the common x axis)."""
    fig = go.Figure()
    palette = ("#000000", "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    symbols = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross")
    drawn = [(name, rep) for name, rep in results.items() if not isinstance(rep, str) and rep.get("blocks")]
    for k, (name, rep) in enumerate(drawn):
        blocks = rep["blocks"]
        # earlier traces are drawn wider and under later ones: where two methods coincide (post-snapkv
        # equals full until its last block) both stay visible, and each differs in colour, dash and marker
        width = 2 + 2.5 * (len(drawn) - 1 - k) / max(len(drawn) - 1, 1)
        fig.add_trace(
            go.Scatter(
                x=list(np.cumsum([b["tokens_in"] for b in blocks])),
                y=[b["kv_bytes"] / MIB for b in blocks],
                mode="lines+markers",
                name=name,
                line={"color": palette[k % len(palette)], "dash": dashes[k % len(dashes)], "width": width},
                marker={"symbol": symbols[k % len(symbols)], "size": 5 + 4 * width / 4.5},
            )
        )
    fig.update_layout(
        xaxis={"title": "tokens read", "tickformat": "d", "rangemode": "tozero"},
        yaxis={"title": "KV MiB after block", "rangemode": "tozero"},
        height=320,
        margin={"l": 50, "r": 10, "t": 20, "b": 40},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig
