"""Where every visual token comes from, and how the sequence splits into blocks.

A model adapter builds one `VisualLayout` per prepared input. The engine only
reads it: blocks are planned from its `units`, telemetry and the app map kept
tokens back to pixels through `box`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class VisualUnit:
    """The smallest piece of media a block may hold: never split by a block.

    kind: "rows" (one token-grid row of an image, Qwen), "tile" (one image tile,
    SmolVLM), "frame" (one video frame, or Qwen's 2-frame temporal patch).
    seq_start/seq_end: the unit's visual tokens in the full token sequence.
    frame: the tile or frame index the unit belongs to.
    """

    kind: str
    frame: int
    seq_start: int
    seq_end: int
    row: int = 0  # grid row (kind "rows"); 0 otherwise

    @property
    def n_tokens(self) -> int:
        return self.seq_end - self.seq_start


@dataclass
class FrameInfo:
    """One image tile or video frame as the LLM sees it."""

    kind: str  # "image", "tile", "global" (SmolVLM thumbnail) or "frame"
    grid: tuple[int, int]  # token grid (rows, cols)
    time: float = 0.0  # seconds (video); 0 for images
    source_frames: tuple[int, ...] = ()  # indices into Media.frames this covers
    box: tuple[int, int, int, int] = (0, 0, 0, 0)  # pixel box in the original media


@dataclass
class VisualLayout:
    """Per-visual-token geometry, in sequence order.

    All arrays have one entry per visual token (n_visual):
    seq_index: position of the token in the full sequence;
    frame: index into `frames`; row/col: place in that frame's token grid;
    box: (x0, y0, x1, y1) pixel box in the original media (ints).
    They are stored as int32 (16 + 16 bytes per token, half of int64: an hour of video is ~540k tokens);
    consumers that index torch tensors convert them (`.long()`).
    """

    seq_index: np.ndarray
    frame: np.ndarray
    row: np.ndarray
    col: np.ndarray
    box: np.ndarray
    frames: list[FrameInfo]
    units: list[VisualUnit]
    media_size: tuple[int, int] = (0, 0)  # (width, height) of the original media
    media_kind: str = "image"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("seq_index", "frame", "row", "col", "box"):
            setattr(self, name, compact_index(getattr(self, name)))

    @property
    def n_visual(self) -> int:
        return int(self.seq_index.shape[0])

    def visual_id_of_seq(self, seq_len: int) -> np.ndarray:
        """Map sequence index -> visual token id (or -1 for text)."""
        out = np.full(seq_len, -1, dtype=np.int64)
        out[self.seq_index] = np.arange(self.n_visual)
        return out

    @staticmethod
    def empty() -> VisualLayout:
        z = np.zeros(0, dtype=np.int64)
        return VisualLayout(z, z, z, z, np.zeros((0, 4), dtype=np.int64), [], [])


def compact_index(values: np.ndarray) -> np.ndarray:
    """Integer array as int32 where its values fit (they always do for token indices, grids and pixel
    boxes: a sequence or an image side beyond 2**31 is refused long before), else unchanged."""
    values = np.asarray(values)
    if values.dtype == np.int32 or values.dtype.kind not in "iu":
        return values
    if values.size and (values.min() < np.iinfo(np.int32).min or values.max() > np.iinfo(np.int32).max):
        return values
    return values.astype(np.int32)


def grid_boxes(rows: int, cols: int, region: tuple[float, float, float, float]) -> np.ndarray:
    """Pixel boxes of a rows x cols token grid laid uniformly over `region`.

    region is (x0, y0, x1, y1) in original-media pixels; returns (rows*cols, 4)
    int boxes in row-major order.
    """
    x0, y0, x1, y1 = region
    xs = np.linspace(x0, x1, cols + 1)
    ys = np.linspace(y0, y1, rows + 1)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    r, c = r.ravel(), c.ravel()
    boxes = np.stack([xs[c], ys[r], xs[c + 1], ys[r + 1]], axis=1)
    return np.round(boxes).astype(np.int64)


@dataclass
class Block:
    """A contiguous span [start, end) of the token sequence run in one forward.

    kind: "text" (no visual token), "bulk" (ordinary forward over several
    units), or the kind of its units ("rows", "tile", "frame").
    units: the visual units inside the span (possibly empty).
    """

    index: int
    kind: str
    start: int
    end: int
    units: list[VisualUnit]

    @property
    def n_visual(self) -> int:
        return sum(u.n_tokens for u in self.units)


def plan_blocks(
    seq_len: int,
    units: list[VisualUnit],
    mode: str,
    block_size: int,
    budget: int | None,
    question_apart: bool = False,
) -> list[Block]:
    """Split the sequence into blocks that never cut a visual unit.

    mode "bulk": one block. "blockwise": a text block for the prompt prefix,
    then greedy groups of whole units with at most `block_size` visual tokens
    (a single unit larger than that forms its own block), then the text
    suffix. "hybrid": like blockwise, but the prefix and the first units that
    fit within `budget` visual tokens form one bulk block; if everything fits,
    the whole input is one bulk block (identical to "bulk").
    Text between units travels with the unit that follows it.
    question_apart: the text after the last unit (the question and the assistant prompt) is always a
    block of its own, so it attends to the media's entries as the cache *stores* them (e.g. packed
    INT8 / INT4) rather than to the fresh full-precision keys of the same forward.
    """
    if mode not in ("bulk", "blockwise", "hybrid"):
        raise ValueError(f"unknown prefill mode {mode!r}")
    if question_apart and units and units[-1].seq_end < seq_len:
        head = plan_blocks(units[-1].seq_end, units, mode, block_size, budget)
        return [*head, Block(len(head), "text", units[-1].seq_end, seq_len, [])]
    if mode == "bulk" or not units:
        return [Block(0, "bulk" if units else "text", 0, seq_len, list(units))]
    if block_size < 1:
        raise ValueError("block_size must be >= 1")

    groups: list[list[VisualUnit]] = []
    first_group: list[VisualUnit] = []
    rest = list(units)
    if mode == "hybrid" and budget is not None:
        total = 0
        while rest and total + rest[0].n_tokens <= budget:
            total += rest[0].n_tokens
            first_group.append(rest.pop(0))
        if not rest:  # all fits in the budget: one ordinary forward
            return [Block(0, "bulk", 0, seq_len, list(units))]
    current: list[VisualUnit] = []
    for unit in rest:
        if current and sum(u.n_tokens for u in current) + unit.n_tokens > block_size:
            groups.append(current)
            current = []
        current.append(unit)
    if current:
        groups.append(current)

    blocks: list[Block] = []
    cursor = 0
    if first_group:
        end = first_group[-1].seq_end
        blocks.append(Block(0, "bulk", 0, end, first_group))
        cursor = end
    elif units[0].seq_start > 0:
        blocks.append(Block(0, "text", 0, units[0].seq_start, []))
        cursor = units[0].seq_start
    for group in groups:
        end = group[-1].seq_end
        blocks.append(Block(len(blocks), group[0].kind, cursor, end, group))
        cursor = end
    if cursor < seq_len:
        blocks.append(Block(len(blocks), "text", cursor, seq_len, []))
    return blocks


def consecutive_runs(items: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [start, end) of sorted integers (rows or frames with gaps where units are absent)."""
    runs, start = [], 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i] != items[i - 1] + 1:
            runs.append((items[start], items[i - 1] + 1))
            start = i
    return runs
