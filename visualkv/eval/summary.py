"""The run's summary: accuracy overall (the benchmark's own average) and per group, KV held, per point;
a text table, ``summary.json`` (with provenance) and the accuracy-vs-KV chart (``accuracy_kv.html``/``.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def summarize(rows: list[dict[str, Any]], plan, module) -> list[dict[str, Any]]:
    """One entry per (method, budget) of `plan` that has rows."""
    out = []
    for point in plan:
        mine = [r for r in rows if r["method"] == point.method and r.get("budget") == point.budget]
        if not mine:
            continue
        entry = {
            "method": point.method,
            "budget": point.budget,
            "n": len(mine),
            "accuracy": round(module.overall(mine), 4),
            "answered": round(sum(r["choice"] is not None for r in mine) / len(mine), 4),
            "mean_peak_kv_bytes": round(sum(r["peak_kv_bytes"] for r in mine) / len(mine)),
            "mean_final_kv_bytes": round(sum(r["final_kv_bytes"] for r in mine) / len(mine)),
            "mean_ttft_seconds": round(sum(r["ttft_seconds"] for r in mine) / len(mine), 4),
            "by_group": _by_group(mine, module.GROUPS),
        }
        recalls = [r["evidence_recall"] for r in mine if r.get("evidence_recall") is not None]
        if recalls:
            entry["mean_evidence_recall"] = round(sum(recalls) / len(recalls), 4)
        out.append(entry)
    return out


def _by_group(rows: list[dict[str, Any]], groups: tuple[str, ...]) -> dict[str, dict[str, dict[str, float]]]:
    """{group: {value: {"accuracy", "n"}}} for each of the benchmark's breakdowns."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    for group in groups:
        values: dict[str, list[bool]] = {}
        for r in rows:
            values.setdefault(r["groups"].get(group, ""), []).append(r["correct"])
        found[group] = {v: {"accuracy": round(sum(c) / len(c), 4), "n": len(c)} for v, c in sorted(values.items())}
    return found


def format_table(entries: list[dict[str, Any]]) -> str:
    lines = [f"{'method':>20} {'budget':>7} {'n':>5} {'accuracy':>9} {'peak KV':>11} {'final KV':>11}  per group"]
    for e in entries:
        groups = "; ".join(
            f"{g}: " + ", ".join(f"{v or '-'} {s['accuracy']:.0%}" for v, s in values.items())
            for g, values in e["by_group"].items()
        )
        lines.append(
            f"{e['method']:>20} {e['budget'] or '-':>7} {e['n']:>5} {e['accuracy']:>9.1%} "
            f"{e['mean_peak_kv_bytes'] / MIB:>7.2f} MiB {e['mean_final_kv_bytes'] / MIB:>7.2f} MiB  {groups}"
        )
    return "\n".join(lines)


def accuracy_figure(entries: list[dict[str, Any]], title: str):
    """Accuracy against the mean KV held after the prefill, one line per method over its budgets."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for method in dict.fromkeys(e["method"] for e in entries):
        mine = sorted((e for e in entries if e["method"] == method), key=lambda e: e["mean_final_kv_bytes"])
        fig.add_trace(
            go.Scatter(
                x=[e["mean_final_kv_bytes"] / MIB for e in mine],
                y=[e["accuracy"] for e in mine],
                text=[f"budget {e['budget']}" if e["budget"] else method for e in mine],
                mode="lines+markers",
                name=method,
                hovertemplate="%{text}<br>KV %{x:.2f} MiB<br>accuracy %{y:.1%}<extra></extra>",
            )
        )
    fig.update_xaxes(title_text="mean KV held after the prefill (MiB)", rangemode="tozero")
    fig.update_yaxes(title_text="accuracy", range=[0, 1.05], tickformat=".0%")
    fig.update_layout(title=title, template="plotly_white", height=440, width=720)
    return fig


def write_summary(rows, items, plan, module, config, argv, log=print) -> dict[str, Any]:
    """Summarize the merged rows of this run's items; write summary.json and the chart; print the table."""
    from visualkv.bench import provenance
    from visualkv.report.viz import save_figure

    ids = {i.item_id for i in items}
    entries = summarize([r for r in rows if r["item_id"] in ids], plan, module)
    out = {
        "kind": "eval",
        "benchmark": config.benchmark,
        "subset": config.subset,
        "model": config.model,
        "prompt": config.prompt,
        "items": len(items),
        "results": entries,
    }
    path = Path(config.out) / "summary.json"
    out = provenance.save_json(out, str(path), provenance.start(argv))
    log(format_table(entries))
    title = f"{config.benchmark}{' ' + config.subset if config.subset else ''}: accuracy vs KV ({config.model})"
    saved = save_figure(accuracy_figure(entries, title), str(Path(config.out) / "accuracy_kv"))
    log("saved", path, *saved)
    return out
