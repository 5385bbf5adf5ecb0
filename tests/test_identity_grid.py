"""Behaviour unchanged: every method and composition on every family's tiny model gives exactly the token ids,
kept sets and KV bytes recorded in tests/identity_grid.json (scripts/identity_grid.py, at the commit it names).

A refactoring of the methods, the engine or the cache must keep every cell equal; a change of behaviour
regenerates the reference with the script's command and says why in its commit.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE = json.loads((REPO / "tests" / "identity_grid.json").read_text())


def _grid_module():
    spec = importlib.util.spec_from_file_location("identity_grid", REPO / "scripts" / "identity_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRID = _grid_module()
CELLS = [(family, method) for family, methods in REFERENCE["grid"].items() for method in methods]


def test_reference_covers_every_method_and_family_with_the_scripts_settings():
    """The reference is the grid the script runs today: the same settings, every family, every method."""
    assert REFERENCE["settings"] == json.loads(
        json.dumps({"budget": GRID.BUDGET, "new_tokens": GRID.NEW_TOKENS, "families": GRID.FAMILIES})
    )
    assert set(REFERENCE["grid"]) == set(GRID.FAMILIES)
    for methods in REFERENCE["grid"].values():
        assert set(GRID.grid_methods()) >= set(methods) and len(methods) >= 14


@pytest.mark.parametrize(("family", "method"), CELLS, ids=[f"{f}:{m}" for f, m in CELLS])
def test_cell_is_identical_to_the_reference(family, method):
    assert GRID.compute_cell(family, method) == REFERENCE["grid"][family][method]
