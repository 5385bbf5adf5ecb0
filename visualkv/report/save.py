"""Write a Plotly figure to disk (HTML, and PNG where a Chromium is available)."""

from __future__ import annotations

import os
import shutil

import plotly.graph_objects as go


def save_figure(fig: go.Figure, stem: str) -> list[str]:
    """Write stem.html and, where a Chromium is available for kaleido, stem.png."""
    saved = [stem + ".html"]
    fig.write_html(saved[0], include_plotlyjs="cdn")
    browser = os.environ.get("BROWSER_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    if browser:
        os.environ.setdefault("BROWSER_PATH", browser)
        try:
            fig.write_image(stem + ".png")
            saved.append(stem + ".png")
        except Exception as exc:  # noqa: BLE001 - PNG export is optional
            print(f"note: PNG export skipped ({type(exc).__name__}: {str(exc)[:120]})")
    return saved
