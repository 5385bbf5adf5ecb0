"""Compression methods. Each is a small class the engine calls at fixed points (a scorer is one `score`, see
visualkv.methods.scorer); methods compose by name ("blockwise-keydiff+salicache", see visualkv.methods.compose).
`register` adds one: the CLI, the app, Compare and the compositions read this registry."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from visualkv.errors import ConfigError
from visualkv.methods.base import Method
from visualkv.methods.blockwise import BlockwiseKeyDiff, BlockwiseSnapKV
from visualkv.methods.compose import (
    SEPARATOR,
    MethodTraits,
    combine_traits,
    composed_names,
    make_pipeline,
    stage_classes,
)
from visualkv.methods.full import FullCache
from visualkv.methods.lightkv import LightKV
from visualkv.methods.options import Option, declared
from visualkv.methods.post_prefill import PostPrefillSnapKV
from visualkv.methods.random_eviction import BlockwiseRandom
from visualkv.methods.salicache import SaliCache

#: the single methods (classes); composed names are built from them
METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Make method `cls` choosable everywhere under `cls.name` (usable as a class decorator)."""
    METHODS[cls.name] = cls
    return cls


for _cls in (FullCache, BlockwiseKeyDiff, BlockwiseSnapKV, PostPrefillSnapKV, SaliCache, LightKV, BlockwiseRandom):
    register(_cls)
for _module in pkgutil.iter_modules(__path__):  # a method file added here registers itself (`@register`)
    importlib.import_module(f"{__name__}.{_module.name}")


def option_flags() -> dict[str, tuple[Option, list[str]]]:
    """{CLI flag: (its declared option, the methods that take it)} over every registered method."""
    out: dict[str, tuple[Option, list[str]]] = {}
    for name, cls in METHODS.items():
        for opt in declared(cls.Config):
            if opt.flag:
                out.setdefault(opt.flag, (opt, []))[1].append(name)
    return out


def shared_caps() -> dict[str, float]:
    """{option name: its cap on a shared instance} for every registered method's options that declare one (what
    they cost grows with their value: SnapKV's window, Sali-Cache's motion-pass width)."""
    return {o.name: o.shared_max for c in METHODS.values() for o in declared(c.Config) if o.shared_max is not None}


def method_names() -> list[str]:
    """Every choosable method name: the single methods, then every valid composition (for menus, --method)."""
    return [*METHODS, *composed_names(METHODS)]


def method_traits(name: str) -> MethodTraits:
    """The flags of method `name` (single or composed) without building it; ConfigError if unknown/refused."""
    return combine_traits(stage_classes(name, METHODS) if SEPARATOR in name else [_single(name)])


def capacity_bound(method: type[Method] | MethodTraits, budget: int | None, blocks, prepared) -> int | None:
    """Entries per layer the cache will be sized for by `method` (a class, or the traits of a single or
    composed name) over the planned `blocks`: the smallest bound of its stages, as a pipeline's
    `capacity_hint`; None when no stage bounds it (the cache grows geometrically)."""
    classes = [METHODS[n] for n in method.stages] if isinstance(method, MethodTraits) else [method]
    bounds = [b for b in (c.capacity_bound(budget, blocks, prepared) for c in classes) if b is not None]
    return min(bounds, default=None)


def layer_budget_bound(method: type[Method] | MethodTraits, budget: int | None) -> int | None:
    """The most visual entries per KV head a layer of `method` (a class, or a name's traits) keeps after a block
    under `budget`: its evicting stage's `layer_budget_bound` (the budget itself for most)."""
    if budget is None:
        return None
    classes = [METHODS[n] for n in method.stages] if isinstance(method, MethodTraits) else [method]
    return max((c.layer_budget_bound(budget) for c in classes if c.evicts_per_block), default=budget)


def make_method(name: str, **options: Any) -> Method:
    """Instantiate a method by name (single or composed with "+"); ConfigError (a ValueError for callers
    that catch that too) listing the known ones."""
    if SEPARATOR in name:
        return make_pipeline(name, METHODS, options)
    return _single(name)(**options)


def _single(name: str) -> type[Method]:
    """The class of single method `name`; UnknownMethodError (one line, listing the known ones) otherwise."""
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)} (or compose with +)")
    return METHODS[name]


class UnknownMethodError(ConfigError, ValueError):
    """An unknown method name."""
