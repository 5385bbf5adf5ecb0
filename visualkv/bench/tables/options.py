"""Every method's options, from their declarations (visualkv.methods.options): docs/CLI.md's reference."""

from __future__ import annotations

from pathlib import Path

from visualkv.bench.tables.format import render_with_source


def method_options_table(results: Path) -> str:
    """One row per declared option: the methods taking it, its CLI flag, default, range and help line."""
    from visualkv.methods import METHODS
    from visualkv.methods.options import declared

    by_config: dict[type, list[str]] = {}
    for name, cls in METHODS.items():
        by_config.setdefault(cls.Config, []).append(f"`{name}`")
    rows = []
    for config, methods in by_config.items():
        for opt in declared(config):
            span = f"{opt.low:,g} to {opt.high:,}" if opt.low is not None else ""
            flag = f"`{opt.flag}`" if opt.flag else "(app, library)"
            rows.append([", ".join(methods), f"`{opt.name}`", flag, f"`{opt.default}`", span, opt.help])
    header = ["method", "option", "CLI flag", "default", "range", "what it sets"]
    note = "The app's settings for a method and its caps on a shared instance come from the same declarations."
    source = "Source: computed from `declared(Config)` for each method in `visualkv/methods/` (not measured)."
    return render_with_source(header, rows, note, source)


TABLES = {"method-options": method_options_table}
#: computed from the code, not measured (`visualkv.bench.staleness`)
MEASURES: dict[str, tuple[str, ...]] = {"method-options": ()}
