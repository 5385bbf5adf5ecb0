"""Which method-specific views apply to a report (a view of a missing field returns None)."""

from __future__ import annotations

from typing import Any


def is_video(report: dict[str, Any]) -> bool:
    return (report.get("media") or {}).get("kind") == "video" or bool(report.get("frames"))


def has_saliency(report: dict[str, Any]) -> bool:
    return bool(report.get("saliency")) or bool(report.get("tier"))


def has_merge_map(report: dict[str, Any]) -> bool:
    return bool(report.get("merge_map")) or bool(report.get("layer_tokens"))


def has_motion(report: dict[str, Any]) -> bool:
    return any("motion" in f for f in report.get("frames") or [])
