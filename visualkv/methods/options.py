"""A method's options, declared once on its config dataclass: type, default, bounds, help, CLI flag.

`option(...)` is a dataclass field carrying that declaration; `Options` checks the bounds after init (one line
naming the option). The CLI flags, the app's settings, the shared-mode caps and docs/CLI.md read `declared(cls)`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from visualkv.errors import ConfigError, check_range


@dataclass(frozen=True)
class Option:
    """One declared option: its field `name`, type hint, default, `help` line, bounds (`low`..`high`, `whole`
    numbers), its CLI `flag` (None: not on the command line) and its cap on a shared instance (`shared_max`)."""

    name: str
    type: Any
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    whole: bool = False
    flag: str | None = None
    metavar: str | None = None
    shared_max: float | None = None


def option(default: Any, help: str, **declared: Any) -> Any:
    """A config field with its declaration (the keywords of `Option` past `help`)."""
    return dataclasses.field(default=default, metadata={"option": (help, declared)})


@dataclass
class Options:
    """Base of a method's config: checks every declared bound, naming the option as `<label> <name>`."""

    label: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for opt in declared(type(self)):
            value = getattr(self, opt.name)
            if opt.low is not None and value is not None:
                check_range(f"{self.label} {opt.name}".strip(), value, opt.low, opt.high, whole=opt.whole)


def declared(config: type) -> list[Option]:
    """The declared options of config dataclass `config`, in field order."""
    hints = typing.get_type_hints(config)
    out = []
    for f in dataclasses.fields(config):
        if "option" in f.metadata:
            help, kw = f.metadata["option"]
            out.append(Option(f.name, hints.get(f.name), f.default, help, **kw))
    return out


def build_config(config: type, method: str, options: dict[str, Any]) -> Any:
    """`config(**options)`; ConfigError (one line) naming an unknown option and the known ones."""
    known = [f.name for f in dataclasses.fields(config) if f.init]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"unknown {method} option(s): {', '.join(unknown)}; known: {', '.join(known) or 'none'}")
    return config(**options)


@dataclass
class NoOptions(Options):
    """The config of a method without options."""
