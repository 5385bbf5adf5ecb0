"""Composed methods: stages that stack through the one `Method` interface (no code per combination).

The methods act at different hook points, so a composition is an ordered list of stages: "entry"
(Sali-Cache: what enters the LLM and at which precision, in `begin`), "merge" (LightKV, in `after_layer`) and
"evict" (block-wise KeyDiff / SnapKV: M visual entries per KV head over every tier, in `after_layer`). A
composed name joins stage names with "+", base method first (``blockwise-keydiff+salicache``); stages run in
role order whatever the order in the name, and the prefill mode is the bounded stage's, so a bounded pipeline
never runs the media in one bulk forward.

Refused (one-line ConfigError): a stage that does not compose (`full`; `post-snapkv`, which bounds nothing per
block), two stages of the same role (two evictions would fight over one budget), and a stage next to a role it
declares a conflict with (`Method.compose_conflicts`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from visualkv.devices import to_device
from visualkv.errors import ConfigError
from visualkv.methods.base import LayerState, Method, PrefillContext

SEPARATOR = "+"
#: the order stages run in (entry decisions first, eviction last, after the block is final); a composed name
#: lists them the other way round (the base method first, then what is stacked on it)
ROLES = ("entry", "merge", "evict")
_FLAGS = ("needs_budget", "evicts_per_block", "query_aware", "question_apart")


@dataclass(frozen=True)
class MethodTraits:
    """What callers read from a method before instantiating it (the class flags of `Method`)."""

    name: str
    description: str
    default_prefill: str
    needs_budget: bool
    evicts_per_block: bool
    query_aware: bool
    question_apart: bool
    stages: tuple[str, ...]


def combine_traits(classes: list[type[Method]]) -> MethodTraits:
    """The flags of a pipeline of `classes` (already in run order); one class gives its own flags."""
    bounded = [c for c in classes if c.evicts_per_block]
    return MethodTraits(
        name=SEPARATOR.join(c.name for c in reversed(classes)),
        description=" + ".join(c.description for c in classes),
        default_prefill=(bounded or classes)[0].default_prefill,
        stages=tuple(c.name for c in classes),
        **{flag: any(getattr(c, flag) for c in classes) for flag in _FLAGS},
    )


def stage_classes(name: str, registry: dict[str, type[Method]]) -> list[type[Method]]:
    """The stage classes of a composed `name`, in run order; ConfigError (one line) if refused."""
    parts = [p.strip() for p in name.split(SEPARATOR)]
    unknown = [p for p in parts if p not in registry]
    if unknown:
        raise ConfigError(
            f"unknown method {', '.join(map(repr, unknown))} in {name!r}; choose from {', '.join(registry)}"
        )
    if len(set(parts)) != len(parts):
        raise ConfigError(f"{name!r} names a method twice")
    classes = [registry[p] for p in parts]
    for cls in classes:
        if cls.compose_role is None:
            composable = ", ".join(n for n, c in registry.items() if c.compose_role)
            raise ConfigError(f"{cls.name} does not compose ({cls.compose_refusal}); composable: {composable}")
    for role in ROLES:
        same = [c.name for c in classes if c.compose_role == role]
        if len(same) > 1:
            raise ConfigError(f"{' and '.join(same)} both {role}; compose at most one of them")
    if conflict := _conflict(classes):
        raise ConfigError(conflict)
    return sorted(classes, key=lambda c: ROLES.index(c.compose_role))


def _conflict(classes: list[type[Method]]) -> str | None:
    """The one-line refusal of the first stage that declares a conflict with another stage's role, or None."""
    for cls, other in ((c, o) for c in classes for o in classes if o is not c):
        if other.compose_role in cls.compose_conflicts:
            return f"{cls.name} does not compose with {other.name} ({cls.compose_conflicts[other.compose_role]})"
    return None


def composed_names(registry: dict[str, type[Method]]) -> list[str]:
    """Every valid composition of two or more registered methods (one per role at most), canonical names."""
    by_role = [[None, *(n for n, c in registry.items() if c.compose_role == role)] for role in reversed(ROLES)]
    picks = ([n for n in pick if n] for pick in itertools.product(*by_role))
    valid = (names for names in picks if len(names) >= 2 and not _conflict([registry[n] for n in names]))
    return [SEPARATOR.join(names) for names in valid]


class Pipeline(Method):
    """Stages run through the one interface, in role order; the class flags of `Method` are combined over them
    (instance properties: read them through `visualkv.methods.method_traits(name)` when there is no instance)."""

    def __init__(self, stages: list[Method]) -> None:
        self.stages = stages
        self.traits = combine_traits([type(s) for s in stages])

    @property
    def stored_shares(self) -> tuple[float, float, float] | None:
        return next((s.stored_shares for s in self.stages if s.stored_shares is not None), None)

    def begin_bytes(self, prepared) -> int:
        return max(s.begin_bytes(prepared) for s in self.stages)  # the stages' passes run one after another

    def layer_scratch_bytes(self, adapter, prepared, visual_ids, q: int) -> int:
        return max(s.layer_scratch_bytes(adapter, prepared, visual_ids, q) for s in self.stages)  # one at a time

    def visual_kept_by_layer(self, adapter, prepared, visual_ids) -> list[tuple[int, int]]:
        """The merging stage's, else the entry stage's (one of each at most; an evicting stage's budget is the guard's)."""
        kept = next((s for role in ("merge", "entry") for s in self.stages if s.compose_role == role), super())
        return kept.visual_kept_by_layer(adapter, prepared, visual_ids)

    @property  # type: ignore[override]
    def proxy_ids(self):
        return self.stages[0].proxy_ids

    @proxy_ids.setter
    def proxy_ids(self, value) -> None:  # a follow-up re-prefill's question reaches every stage
        for stage in self.stages:
            stage.proxy_ids = value

    def begin(self, ctx: PrefillContext) -> None:
        for stage in self.stages:
            stage.begin(ctx)

    def capacity_hint(self, ctx: PrefillContext) -> int | list[int] | None:
        """The smallest of the stages' hints, layer by layer where one of them gives a count per layer."""
        hints = [h for h in (s.capacity_hint(ctx) for s in self.stages) if h is not None]
        if not any(isinstance(h, list) for h in hints):
            return min(hints, default=None)
        layers = ctx.adapter.num_layers
        return [min(h[i] if isinstance(h, list) else h for h in hints) for i in range(layers)]

    def select_rows(self, ctx: PrefillContext, hidden: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        """Each stage chooses among the rows the stages before it kept; returns the block's rows kept by all."""
        kept = None  # host indices of the rows kept so far (None: all)
        for stage in self.stages:
            seen = hidden if kept is None else hidden.index_select(1, to_device(kept, hidden.device))
            rows = stage.select_rows(ctx, seen, local if kept is None else local[kept])
            if kept is not None:  # a stage's in-place writes (merged embeddings) reach the block
                hidden.index_copy_(1, to_device(kept, hidden.device), seen)
            if rows is not None:
                kept = rows if kept is None else kept[rows]
        return kept

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> LayerState | None:
        changed = None
        for stage in self.stages:
            changed = stage.after_layer(ctx, changed or state) or changed
        return changed

    def end(self, ctx: PrefillContext) -> None:
        for stage in self.stages:
            stage.end(ctx)

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        """Every stage's fields; a field two stages report differently is kept under "stage:field"."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            for key, value in stage.report(ctx).items():
                out[f"{stage.name}:{key}" if key in out and out[key] != value else key] = value
        out["stages"] = list(self.traits.stages)
        return out

    def config_dict(self) -> dict[str, Any]:
        return {"method": self.name, "stages": [s.config_dict() for s in self.stages]}


for _trait in ("name", "description", "default_prefill", *_FLAGS):
    setattr(Pipeline, _trait, property(lambda self, trait=_trait: getattr(self.traits, trait)))


def make_pipeline(name: str, registry: dict[str, type[Method]], options: dict[str, Any]) -> Pipeline:
    """A `Pipeline` for composed `name`. `options`: {stage name: {its options}}, or flat options, each sent
    to the one stage whose `Config` declares it (ConfigError if none or several do)."""
    classes = stage_classes(name, registry)
    per_stage: dict[str, dict[str, Any]] = {c.name: {} for c in classes}
    for key, value in options.items():
        if key in per_stage:
            if not isinstance(value, dict):
                raise ConfigError(f"options of stage {key!r} must be a mapping, got {value!r}")
            per_stage[key].update(value)
            continue
        takers = [c.name for c in classes if key in {f.name for f in dataclasses.fields(c.Config)}]
        if len(takers) != 1:
            what = "no stage" if not takers else f"several stages ({', '.join(takers)})"
            raise ConfigError(f"option {key!r} fits {what} of {name}; pass it as {{stage: {{{key!r}: ...}}}}")
        per_stage[takers[0]][key] = value
    return Pipeline([cls(**per_stage[cls.name]) for cls in classes])
