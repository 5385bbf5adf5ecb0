"""Composed methods: stages that stack through the one `Method` interface (no code per combination).

The methods act at different hook points, so a composition is an ordered list of stages: "entry"
(Sali-Cache: what enters the LLM and at which precision, in `begin`), "merge" (LightKV, in `after_layer`) and
"evict" (block-wise KeyDiff / SnapKV: M visual entries per KV head over every tier, in `after_layer`). A
composed name joins stage names with "+", base method first (``blockwise-keydiff+salicache``); stages run in
role order whatever the order in the name, and the prefill mode is the bounded stage's, so a bounded pipeline
never runs the media in one bulk forward.

Refused (one-line ConfigError): a stage that does not compose (`full`; `post-snapkv`, which bounds nothing per
block) and two stages of the same role (two evictions would fight over one budget).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import typing
from dataclasses import dataclass
from typing import Any

from visualkv.errors import ConfigError
from visualkv.methods.base import LayerState, Method, PrefillContext

SEPARATOR = "+"
#: order the stages run in (entry decisions first, eviction last, after the block is final)
RUN_ORDER = ("entry", "merge", "evict")
#: order a composed name lists them in (the base method first, then what is stacked on it)
NAME_ORDER = ("evict", "merge", "entry")
#: roles of registered methods that do not declare `compose_role` themselves (LightKV's module is kept apart)
ROLE_OF = {"lightkv": "merge"}


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
    stores_packed: bool
    merges_between_layers: bool
    stages: tuple[str, ...]


def role_of(cls: type[Method]) -> str | None:
    return cls.compose_role or ROLE_OF.get(cls.name)


def combine_traits(classes: list[type[Method]]) -> MethodTraits:
    """The flags of a pipeline of `classes` (already in run order); one class gives its own flags."""
    bounded = [c for c in classes if c.evicts_per_block]
    names = [c.name for c in sorted(classes, key=lambda c: NAME_ORDER.index(role_of(c) or "evict"))]
    return MethodTraits(
        name=SEPARATOR.join(names) if len(classes) > 1 else classes[0].name,
        description=" + ".join(c.description for c in classes),
        default_prefill=(bounded or classes)[0].default_prefill,
        needs_budget=any(c.needs_budget for c in classes),
        evicts_per_block=any(c.evicts_per_block for c in classes),
        query_aware=any(c.query_aware for c in classes),
        question_apart=any(c.question_apart for c in classes),
        stores_packed=any(c.stores_packed for c in classes),
        merges_between_layers=any(c.merges_between_layers for c in classes),
        stages=tuple(c.name for c in classes),
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
    composable = [n for n, c in registry.items() if role_of(c)]
    for cls in classes:
        if role_of(cls) is None:
            raise ConfigError(
                f"{cls.name} does not compose ({cls.compose_refusal}); composable: {', '.join(composable)}"
            )
    for role in RUN_ORDER:
        same = [c.name for c in classes if role_of(c) == role]
        if len(same) > 1:
            raise ConfigError(f"{' and '.join(same)} both {role}; compose at most one of them")
    return sorted(classes, key=lambda c: RUN_ORDER.index(role_of(c)))


def composed_names(registry: dict[str, type[Method]]) -> list[str]:
    """Every valid composition of two or more registered methods (one per role at most), canonical names."""
    by_role = {role: [n for n, c in registry.items() if role_of(c) == role] for role in NAME_ORDER}
    out = []
    for pick in itertools.product(*([None, *by_role[r]] for r in NAME_ORDER)):
        names = [n for n in pick if n is not None]
        if len(names) >= 2:
            out.append(SEPARATOR.join(names))
    return out


class Pipeline(Method):
    """Stages run through the one interface; see the module docstring."""

    def __init__(self, stages: list[Method]) -> None:
        self.stages = stages
        self.traits = combine_traits([type(s) for s in stages])
        self._proxy_ids = None

    # the class flags of `Method`, combined over the stages (instance properties: read them through
    # `visualkv.methods.method_traits(name)` when there is no instance)
    name = property(lambda self: self.traits.name)  # type: ignore[assignment]
    description = property(lambda self: self.traits.description)  # type: ignore[assignment]
    default_prefill = property(lambda self: self.traits.default_prefill)  # type: ignore[assignment]
    needs_budget = property(lambda self: self.traits.needs_budget)  # type: ignore[assignment]
    evicts_per_block = property(lambda self: self.traits.evicts_per_block)  # type: ignore[assignment]
    query_aware = property(lambda self: self.traits.query_aware)  # type: ignore[assignment]
    question_apart = property(lambda self: self.traits.question_apart)  # type: ignore[assignment]
    stores_packed = property(lambda self: self.traits.stores_packed)  # type: ignore[assignment]
    merges_between_layers = property(lambda self: self.traits.merges_between_layers)  # type: ignore[assignment]

    @property
    def stored_shares(self) -> tuple[float, float, float] | None:
        return next((s.stored_shares for s in self.stages if s.stored_shares is not None), None)

    def begin_bytes(self, prepared) -> int:
        return max(s.begin_bytes(prepared) for s in self.stages)  # the stages' passes run one after another

    def visual_kept_by_layer(self, adapter, prepared, visual_ids) -> list[tuple[int, int]]:
        """The merging stage's (at most one per pipeline; an evicting stage's budget is the guard's own term)."""
        merging = next((s for s in self.stages if s.merges_between_layers), None)
        return (merging or super()).visual_kept_by_layer(adapter, prepared, visual_ids)

    @property  # type: ignore[override]
    def proxy_ids(self):
        return self._proxy_ids

    @proxy_ids.setter
    def proxy_ids(self, value) -> None:  # a follow-up re-prefill's question reaches every stage
        self._proxy_ids = value
        for stage in self.stages:
            stage.proxy_ids = value

    def begin(self, ctx: PrefillContext) -> None:
        for stage in self.stages:
            stage.begin(ctx)

    def capacity_hint(self, ctx: PrefillContext) -> int | None:
        hints = [h for h in (s.capacity_hint(ctx) for s in self.stages) if h is not None]
        return min(hints) if hints else None

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> LayerState | None:
        changed = None
        for stage in self.stages:
            new = stage.after_layer(ctx, changed or state)
            if new is not None:
                changed = new
        return changed

    def end(self, ctx: PrefillContext) -> None:
        for stage in self.stages:
            stage.end(ctx)

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        """Every stage's fields; a field two stages report differently is kept under "stage:field"."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            for key, value in stage.report(ctx).items():
                if key in out and out[key] != value:
                    key = f"{stage.name}:{key}"
                out[key] = value
        out["stages"] = list(self.traits.stages)
        return out

    def config_dict(self) -> dict[str, Any]:
        return {"method": self.name, "stages": [s.config_dict() for s in self.stages]}


def make_pipeline(name: str, registry: dict[str, type[Method]], options: dict[str, Any]) -> Pipeline:
    """A `Pipeline` for composed `name`. `options`: {stage name: {its options}}, or flat options, each sent
    to the one stage whose constructor takes it (ConfigError if none or several do)."""
    classes = stage_classes(name, registry)
    per_stage: dict[str, dict[str, Any]] = {c.name: {} for c in classes}
    for key, value in options.items():
        if key in per_stage:
            if not isinstance(value, dict):
                raise ConfigError(f"options of stage {key!r} must be a mapping, got {value!r}")
            per_stage[key].update(value)
            continue
        takers = [c.name for c in classes if _accepts(c, key)]
        if len(takers) != 1:
            what = "no stage" if not takers else f"several stages ({', '.join(takers)})"
            raise ConfigError(f"option {key!r} fits {what} of {name}; pass it as {{stage: {{{key!r}: ...}}}}")
        per_stage[takers[0]][key] = value
    stages = []
    for cls in classes:
        try:
            stages.append(cls(**per_stage[cls.name]))
        except TypeError as exc:
            raise ConfigError(f"{cls.name}: {exc}") from None
    return Pipeline(stages)


def _accepts(cls: type[Method], key: str) -> bool:
    """Does `cls(**{key: ...})` take `key`: a named parameter, or (with **options) a field of a dataclass
    config parameter (Sali-Cache takes its config's fields as keywords)."""
    params = inspect.signature(cls.__init__).parameters
    if (
        key in params
        and key != "self"
        and params[key].kind not in (params[key].VAR_POSITIONAL, params[key].VAR_KEYWORD)
    ):
        return True
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return False
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: only named parameters count
        return False
    for hint in hints.values():
        for t in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(t) and key in {f.name for f in dataclasses.fields(t)}:
                return True
    return False
