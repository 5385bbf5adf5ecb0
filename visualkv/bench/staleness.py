"""Whether a generated table's figures still describe the code: the commits it was measured at against the newest
commit touching the code it measures.

Each table module declares, beside its ``TABLES``, ``MEASURES``: block name -> the source paths (files or folders,
from the repository root) whose code the table's figures measure (empty: a table that measures no library code).
A table is stale when one of the commits its source line names does not have the newest commit touching those
paths (``git log -1 --format=%H -- PATHS``) in its history, or when a source of it recorded no commit at all. Commit
ancestry (``git merge-base --is-ancestor``), not dates, decides, so the verdict depends only on the checkout's
history: a stale table's block opens with a note naming both commits.

Without that history (no git, not a checkout, or a shallow clone, whose boundary commit would pass for the newest
change to every path) `History.read` gives None and the documents keep the notes they carry, unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from visualkv.bench.provenance import git_output

#: how a source line names a measured commit (`visualkv.bench.tables.format.commit_phrase`) and a source entry
_COMMIT = re.compile(r"\bcommit `([0-9a-f]{7,40})`")
_ENTRY = re.compile(r"\[`[^`]+`\]\(")
#: the note's first words: a generated block that opens with them carries a staleness note
NOTE_PREFIX = "> **Measured before the code's last change.**"
UNCHECKED = (
    "staleness notes kept as the documents carry them, not checked: that needs git and the full history "
    "(in a shallow clone: git fetch --unshallow)"
)


@dataclass(frozen=True)
class History:
    """The git history of a full (not shallow) checkout at `root`."""

    root: Path

    @classmethod
    def read(cls, root: Path) -> History | None:
        """The history at `root`, or None without git, outside a checkout or in a shallow clone."""
        shallow = git_output(str(root), "rev-parse", "--is-shallow-repository")
        return cls(root) if shallow is not None and shallow.strip() == "false" else None

    def last_change(self, paths: tuple[str, ...]) -> str:
        """The full sha of the newest commit touching `paths` (ValueError when none does: a mistyped path)."""
        sha = (git_output(str(self.root), "log", "-1", "--format=%H", "--", *paths) or "").strip()
        if not sha:
            raise ValueError(f"no commit touches {', '.join(paths)}: a measured path that does not exist?")
        return sha

    def holds(self, commit: str) -> bool:
        return git_output(str(self.root), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}") is not None

    def contains(self, commit: str, ancestor: str) -> bool:
        """`ancestor` is `commit` or in its history."""
        return git_output(str(self.root), "merge-base", "--is-ancestor", ancestor, commit) is not None


def staleness_note(table: str, paths: tuple[str, ...], where: str, history: History) -> str:
    """The note for a table (its generated Markdown, whose source line names the commits measured) measuring
    `paths` (declared in the module `where`), or "" when each of its sources was measured at a commit that holds
    the newest change to `paths`."""
    if not paths:
        return ""
    source = next((p for p in reversed(table.split("\n\n")) if p.startswith("Source: ")), "")
    named, files = _COMMIT.findall(source), len(_ENTRY.findall(source))
    commits = list(dict.fromkeys(named))
    last = history.last_change(paths)
    older = [c for c in commits if history.holds(c) and not history.contains(c, last)]
    foreign = [c for c in commits if not history.holds(c)]
    measured = []
    if older:
        measured.append("at " + _commits(older))
    if foreign:
        measured.append("at " + _commits(foreign) + " (not in this checkout's history)")
    if files > len(named):
        measured.append(f"at a commit not recorded ({files - len(named)} of {files} files)")
    if not measured:
        return ""
    return (
        f"{NOTE_PREFIX} These figures were measured {' and '.join(measured)}. The code they measure (`MEASURES` "
        f"in `{where}`) last changed in commit `{last[:7]}`: they may not describe the code at this commit."
    )


def _commits(commits: list[str]) -> str:
    return ("commit " if len(commits) == 1 else "commits ") + ", ".join(f"`{c[:7]}`" for c in commits)


def note_of(block: str) -> str:
    """The staleness note a generated block opens with, or ""."""
    return block.partition("\n\n")[0] if block.startswith(NOTE_PREFIX) else ""


def with_note(note: str, table: str) -> str:
    return f"{note}\n\n{table}" if note else table
