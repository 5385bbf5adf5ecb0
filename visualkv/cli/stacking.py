"""Sali-Cache stacked on a method by the CLI's `--skip-frames` / `--tiers` / `--flow-threshold`."""

from __future__ import annotations

from typing import Any

from visualkv.errors import ConfigError
from visualkv.methods import method_names, method_traits
from visualkv.methods.compose import SEPARATOR
from visualkv.methods.full import FullCache
from visualkv.methods.salicache import SaliCache


def stacked_method(
    method: str, skip_frames: bool = False, tiers: Any = None, flow_threshold: float | None = None
) -> tuple[str, dict[str, Any]]:
    """(method name, Sali-Cache options) for `method` with frame skipping and/or saliency tiers on top.

    `--method blockwise-keydiff --skip-frames --tiers 0.43,0.10,0.29` is `blockwise-keydiff+salicache`
    with those tiers. Skipping alone keeps every token at full precision (tiers 1,0,0); tiers alone skip
    nothing (flow threshold 0). Nothing asked: (method, {}). ConfigError (one line) when the result does
    not compose, `full` included (it means no compression: use `salicache` itself).
    """
    options: dict[str, Any] = {}
    if tiers is not None:
        options["tiers"] = tiers
    if flow_threshold is not None:
        options["flow_threshold"] = flow_threshold
    if not (skip_frames or options):
        return method, {}
    has_entry = SaliCache.name in method.split(SEPARATOR)
    if not skip_frames and "flow_threshold" not in options and not has_entry:
        options["flow_threshold"] = 0.0  # tiers only: keep every frame
    if skip_frames and "tiers" not in options and not has_entry:
        options["tiers"] = (1.0, 0.0, 0.0)  # skipping only: every kept token at full precision
    if method == FullCache.name:
        stack_on = [n for n in method_names() if SEPARATOR not in n and f"{n}{SEPARATOR}salicache" in method_names()]
        raise ConfigError(
            "--skip-frames / --tiers / --flow-threshold apply to --method salicache only, or stack on a method "
            f"that composes with it: {', '.join(stack_on)}"
        )
    name = method if has_entry else f"{method}{SEPARATOR}{SaliCache.name}"
    return method_traits(name).name, options
