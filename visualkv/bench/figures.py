"""README / docs tables generated from the committed benchmark JSON (``python -m visualkv bench report``).

A document marks each generated table with a pair of HTML comments::

    <!-- figures:memory-image -->
    ...generated Markdown, never edited by hand...
    <!-- /figures:memory-image -->

`render_document` rewrites what lies between the markers from the JSON files under ``docs/results/``;
`check_documents` reports every block whose text differs from what the JSON gives (a test runs it, so README and
JSON cannot drift apart). The tables themselves live in :mod:`visualkv.bench.tables`, one module per benchmark.
A block whose figures were measured before the last change to the code they measure opens with a note saying so
(:mod:`visualkv.bench.staleness`, from the git history of the checkout).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

from visualkv.bench.staleness import History, note_of, staleness_note, with_note
from visualkv.bench.tables import (
    baselines,
    block_launches,
    compose,
    demo,
    evals,
    evidence,
    fidelity,
    gpu,
    guard,
    kernels,
    latency,
    launches,
    lightkv,
    load,
    memory,
    needle,
    options,
    salicache,
    zerogpu,
)
from visualkv.bench.tables.format import RESULTS, ROOT, Table

#: every document with generated blocks (and every page whose prose tests/test_figures.py checks)
DOCUMENTS = (
    "README.md",
    "docs/RESULTS.md",
    "docs/ARCHITECTURE.md",
    "docs/CLI.md",
    "docs/APP.md",
    "docs/METHODS.md",
    "docs/SALICACHE.md",
    "docs/LIGHTKV.md",
    "docs/DEMO.md",
    "docs/EVAL.md",
)
_BLOCK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.DOTALL)
#: the modules whose `TABLES` the documents draw from
TABLE_MODULES = (
    memory,
    latency,
    fidelity,
    salicache,
    lightkv,
    baselines,
    needle,
    compose,
    guard,
    load,
    launches,
    block_launches,
    kernels,
    gpu,
    demo,
    evidence,
    zerogpu,
    evals,
    options,
)


def _registry(modules: tuple[ModuleType, ...]) -> dict[str, Table]:
    """Block name -> table function, from each module's `TABLES` (a name claimed twice raises)."""
    tables: dict[str, Table] = {}
    for module in modules:
        taken = tables.keys() & module.TABLES.keys()
        if taken:
            raise ValueError(f"{module.__name__} renders blocks another module renders: {sorted(taken)}")
        tables.update(module.TABLES)
    return tables


TABLES = _registry(TABLE_MODULES)
#: block name -> (the source paths its figures measure, the module declaring them), from each module's `MEASURES`
MEASURES = {
    name: (paths, f"{module.__name__.replace('.', '/')}.py")
    for module in TABLE_MODULES
    for name, paths in module.MEASURES.items()
}
#: tables computed from the code (no benchmark JSON): their source line says so
COMPUTED = {"lightkv-schedule", "salicache-bytes", "zerogpu-fit", "method-options"}


# -- documents -------------------------------------------------------------------------------------
def render_document(text: str, results: Path = RESULTS, in_docs: bool = False, history: History | None = None) -> str:
    """`text` with every marked block regenerated (unknown table names raise KeyError), each opening with its
    staleness note from `history` (without a history, the note a block carries is kept as it is).

    in_docs: the document lives in docs/, so links to the JSON are relative to it."""

    def sub(m: re.Match) -> str:
        name = m.group(2)
        table = TABLES[name](results)
        if in_docs:
            table = table.replace("](docs/results/", "](results/").replace("](assets/", "](../assets/")
        note = note_of(m.group(3)) if history is None else staleness_note(table, *MEASURES[name], history)
        return f"{m.group(1)}{with_note(note, table)}\n{m.group(4)}"

    return _BLOCK.sub(sub, text)


def blocks_in(text: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(text)]


def check_documents(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """Names ("README.md: memory-image") of generated blocks that disagree with the JSON or, given the full git
    history at `root`, with their staleness note."""
    stale, history = [], History.read(root)
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        fresh = render_document(text, results, doc.startswith("docs/"), history)
        if fresh != text:
            old = {m.group(2): m.group(3) for m in _BLOCK.finditer(text)}
            new = {m.group(2): m.group(3) for m in _BLOCK.finditer(fresh)}
            stale += [f"{doc}: {name}" for name in old if old[name] != new.get(name)]
    return stale


def write_documents(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """Regenerate every marked block in place; returns the documents that changed."""
    changed, history = [], History.read(root)
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        fresh = render_document(text, results, doc.startswith("docs/"), history)
        if fresh != text:
            path.write_text(fresh)
            changed.append(doc)
    return changed


# -- prose -----------------------------------------------------------------------------------------
#: a tracker reference in prose ("issue 11", "issues 11 and 14", "PR #3", "#12"): history belongs in git
ISSUE_REFERENCE = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+|(?<![\w/&#])#\d+\b", re.IGNORECASE)
README_MAX_LINES = 400


def prose_of(text: str) -> str:
    """`text` with the content of every generated block left out (the blocks' markers stay), line count kept."""
    return _BLOCK.sub(lambda m: m.group(1) + "\n" * m.group(3).count("\n") + m.group(4), text)


def issue_references(root: Path = ROOT) -> list[str]:
    """ "doc:line: text" for each line of the documents' own prose (generated blocks aside) that cites a tracker
    number."""
    found = []
    for doc in DOCUMENTS:
        path = root / doc
        if not path.exists():
            continue
        for number, line in enumerate(prose_of(path.read_text()).splitlines(), start=1):
            if ISSUE_REFERENCE.search(line):
                found.append(f"{doc}:{number}: {line.strip()}")
    return found
