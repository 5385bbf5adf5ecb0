"""The benchmarks `eval` knows, by name: each a module with NAME, SUBSETS, GROUPS, read, extract, overall."""

from __future__ import annotations

from types import ModuleType

from visualkv.errors import ConfigError
from visualkv.eval import hrbench, mlvu, videomme, vstar

BENCHMARKS: dict[str, ModuleType] = {m.NAME: m for m in (videomme, mlvu, vstar, hrbench)}


def benchmark(name: str, subset: str | None = None) -> ModuleType:
    """The reader module of `name`, its `subset` checked (one-line ConfigError otherwise)."""
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark '{name}'; choose one of {', '.join(BENCHMARKS)}")
    module = BENCHMARKS[name]
    if subset is not None and subset not in module.SUBSETS:
        raise ConfigError(f"--subset {subset}: {name} has {', '.join(module.SUBSETS)}")
    return module
