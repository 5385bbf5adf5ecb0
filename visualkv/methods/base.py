"""The one interface every compression method plugs into.

The engine calls a method at five points of a prefill, and never branches on
which method it is:

- `begin(ctx)`: before any block; may compute proxy queries, drop frames or
  tokens (`ctx.prepared.keep`), assign precision tiers (`ctx.tiers`).
- `select_rows(ctx, hidden, local)`: per block, once its tokens are embedded
  (the vision tower has run) and before the decoder layers; may drop visual rows
  from what enters the LLM, by their embeddings.
- `after_layer(ctx, state)`: after each decoder layer of each block; may evict
  from that layer's cache, or shrink the block's hidden states (merging).
- `end(ctx)`: after the last block; may compress the whole cache (post-prefill).
- `report(ctx)`: extra fields for the JSON report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from visualkv.devices import to_device
from visualkv.errors import PrefillStopped
from visualkv.kv.cache import CompressibleCache
from visualkv.layout import Block
from visualkv.methods.options import NoOptions, build_config
from visualkv.models.base import ModelAdapter, PreparedInput


@dataclass
class PrefillContext:
    """Everything a method may read or change during one media prefill."""

    adapter: ModelAdapter
    cache: CompressibleCache
    prepared: PreparedInput
    budget: int | None
    block_size: int
    prefill_mode: str
    seq_offset: int = 0  # global index of prepared token 0 in the conversation
    blocks: list[Block] = field(default_factory=list)
    block: Block | None = None
    tiers: torch.Tensor | None = None  # (L,) tier per prepared token, or None = all full precision
    #: shares (full, int8, int4) of the stored visual tokens per tier, set by a method that assigns tiers;
    #: an eviction method splits its budget M by them (`tier_budgets`), so every tier is bounded
    tier_shares: tuple[float, float, float] | None = None
    #: host tables of this prefill built once per device (`table_on`); methods keep their own state on themselves
    tables: dict[str, dict[torch.device, torch.Tensor]] = field(default_factory=dict)
    encoded_frames: list[int] = field(default_factory=list)  # tiles/frames sent to the vision tower, in order
    #: the engine's text-pass service: text_pass(ids (n,), positions (P, n), observer) runs the tokens through
    #: every decoder layer in a scratch cache, calling observer.after_layer(ctx, state) after each layer
    #: (proxy queries, the question's hidden states); methods never import the engine
    text_pass: Callable[[torch.Tensor, torch.Tensor, Method], None] | None = None
    #: the turn's Stop (or its time limit): asked before every decoder layer and every few frames of a pass over
    #: the media, so that no step of a prefill outlasts it by more than one layer or frame
    should_stop: Callable[[], bool] | None = None

    def stop_if_asked(self) -> None:
        """Raise PrefillStopped when `should_stop` says so (a Python call: no host synchronisation)."""
        if self.should_stop is not None and self.should_stop():
            raise PrefillStopped()

    def is_visual(self, token_index: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which global token indices (>= 0) are (evictable) visual tokens of this prepared input,
        on token_index's device (one lookup: it runs for every layer of every block that evicts)."""
        return self.lookup(self.visual_by_index_on(token_index.device), token_index)

    def visual_by_index_on(self, device: torch.device) -> torch.Tensor:
        """`is_visual`'s table on `device`: True at the global index of each visual token of the prepared input
        (the engine warms it up before the first block, so no layer waits for a host-to-device copy)."""
        return self.table_on("visual", device, lambda: self.conversation_table(self.prepared.visual_mask, False))

    def conversation_table(self, per_token: torch.Tensor, fill: bool | int) -> torch.Tensor:
        """(seq_offset + seq_len + 1,) host tensor over the conversation so far: `per_token` (one value per token
        of the prepared input) at their global indices, `fill` before them (earlier turns) and in the last slot,
        which `lookup` reads for any index past the input (e.g. an answer being decoded)."""
        table = torch.full((self.seq_offset + self.prepared.seq_len + 1,), fill, dtype=per_token.dtype)
        table[self.seq_offset : self.seq_offset + self.prepared.seq_len] = per_token
        return table

    def table_on(self, name: str, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The host table `build()` makes, on `device`: built and copied once per prefill and device."""
        tables = self.tables.setdefault(name, {})
        if device not in tables:
            tables[device] = to_device(build(), device)
        return tables[device]

    def question_pass(self, proxy_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ids, positions, n) of a text-only pass over [prompt prefix + question + assistant prompt], the question
        at the positions right after the media, its last `n` tokens; `proxy_ids` replace the prompt's own question
        tokens (a follow-up question being re-prefilled)."""
        p = self.prepared
        first_visual = int(p.visual_mask.nonzero()[0]) if p.visual_mask.any() else p.seq_len
        if proxy_ids is None:
            local = torch.cat([torch.arange(first_visual), torch.arange(p.suffix_start, p.seq_len)])
            return p.input_ids[local], p.position_ids[:, local], p.seq_len - p.suffix_start
        n = int(proxy_ids.shape[0])
        question = (torch.arange(n) + int(p.position_ids[0, p.suffix_start])).expand(p.position_ids.shape[0], n)
        positions = torch.cat([p.position_ids[:, :first_visual], question], dim=1)
        return torch.cat([p.input_ids[:first_visual], proxy_ids]), positions, n

    @staticmethod
    def lookup(table: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """A `conversation_table` read at global indices `token_index` (>= 0): two operations, no host read."""
        return table[token_index.clamp(max=table.shape[0] - 1)]


@dataclass
class LayerState:
    """One decoder layer's view of the block being prefilled."""

    layer_idx: int
    hidden_in: torch.Tensor  # (1, q, hidden) input of the layer
    hidden: torch.Tensor  # (1, q, hidden) output of the layer
    positions: torch.Tensor  # (P, q) position ids
    token_index: torch.Tensor  # (q,) global token indices
    cos: torch.Tensor
    sin: torch.Tensor
    tiers: torch.Tensor | None = None  # (q,) tiers of the block's tokens
    #: visual full-precision tokens among them, when a method that changes the block knows it
    n_visual: int | None = None
    #: {tier: positions} of the block's tiers, when a method that changes the block made it (else the engine
    #: splits `tiers` on the host); None with `tiers` set means all full precision
    tier_split: dict[int, torch.Tensor] | None = None


class Method:
    """Base class: does nothing (the full cache). A method is built per prefill, so it keeps its state on itself."""

    name: ClassVar[str] = "full"
    #: the one line the app, `--help` and the docs show
    description: ClassVar[str] = ""
    plain: ClassVar[str] = ""  # one line in everyday words (the app's method list)
    #: its options: a dataclass of `visualkv.methods.options.option` fields (the CLI flags, the app's settings
    #: and the docs are generated from them); `Method(**options)` takes its fields
    Config: ClassVar[type] = NoOptions
    default_prefill: ClassVar[str] = "bulk"
    #: does the method need a budget (M)?
    needs_budget: ClassVar[bool] = False
    #: does the prefill evict each layer to the budget right after every block (so the cache's peak is
    #: about budget + one block, not the whole input)? Read by visualkv.runtime.memory_guard's estimate.
    evicts_per_block: ClassVar[bool] = False
    #: does the kept set depend on the question (so a follow-up may miss things)?
    query_aware: ClassVar[bool] = False
    #: run the question as a block of its own after the media, so it reads the media from the cache as
    #: stored (a method that stores entries lossily wants its first answer token to see that loss)
    question_apart: ClassVar[bool] = False
    #: what the method does in a composed pipeline (visualkv.methods.compose): "entry" (decides what enters
    #: the LLM and how it is stored, in `begin`), "merge" (shrinks the block inside the forward), "evict"
    #: (bounds each layer after every block); None = not composable
    compose_role: ClassVar[str | None] = None
    #: why a method with no role does not compose (the one-line refusal says it)
    compose_refusal: ClassVar[str] = "it has no role in a pipeline"
    #: {role: why not}: roles this method's stage does not compose with, though the roles alone would allow it
    compose_conflicts: ClassVar[dict[str, str]] = {}
    #: token ids of a question to use as proxy instead of the prompt's own (follow-up re-prefill)
    proxy_ids: torch.Tensor | None = None

    def __init__(self, config: Any = None, **options: Any) -> None:
        self.config = config if config is not None else build_config(self.Config, self.name, options)

    def begin(self, ctx: PrefillContext) -> None:
        """Called once before the first block."""

    def capacity_hint(self, ctx: PrefillContext) -> int | list[int] | None:
        """Entries per layer and head the cache will hold at most during this prefill, if the method
        bounds it (the cache then allocates its buffers once): one count for every layer, or a list of one per
        layer (budgets that differ by layer); None = unbounded (geometric growth)."""
        return self.capacity_bound(ctx.budget, ctx.blocks, ctx.prepared)

    @property
    def stored_shares(self) -> tuple[float, float, float] | None:
        """Fractions of the visual tokens read that are stored at full precision, INT8 and INT4 (the rest pruned),
        when the method stores packed INT8 / INT4 tiers (Sali-Cache; the memory guard bounds each tier's buffers
        by its share); None: every token read is stored at full precision."""
        return None

    def begin_bytes(self, prepared: PreparedInput) -> int:
        """For the memory guard: bytes `begin` holds at once over `prepared` before the first block (Sali-Cache's
        motion pass), besides the media themselves. This default: nothing."""
        return 0

    def layer_scratch_bytes(
        self, adapter: ModelAdapter, prepared: PreparedInput, visual_ids: np.ndarray, q: int
    ) -> int:
        """For the memory guard: bytes `select_rows` or `after_layer` holds at once over a block of `q` tokens whose
        visual ones are `visual_ids` (layout indices), beside its hidden states (VisionZip's ranking, LightKV's merge)."""
        return 0

    def visual_kept_by_layer(
        self, adapter: ModelAdapter, prepared: PreparedInput, visual_ids: np.ndarray
    ) -> list[tuple[int, int]]:
        """For the memory guard: per group of consecutive decoder layers, (layers in it, an upper bound on how many
        of a block's visual tokens `visual_ids` (indices into the layout) each of them stores): those `select_rows`
        lets in (VisionZip), fewer past a merge between layers (LightKV). This default: all of them, everywhere."""
        return [(adapter.num_layers, len(visual_ids))]

    @classmethod
    def capacity_bound(cls, budget: int | None, blocks: list[Block], prepared: PreparedInput) -> int | None:
        """`capacity_hint` from what is known before a prefill (the memory guard asks it with the planned
        blocks, without building the method)."""
        return None

    @classmethod
    def layer_budget_bound(cls, budget: int | None) -> int | None:
        """For the memory guard: the most visual entries per KV head any layer keeps after a block under budget
        `budget` (the budget itself, unless the method spreads it unevenly over the layers)."""
        return budget

    def select_rows(self, ctx: PrefillContext, hidden: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        """Called per block before its decoder layers: which of its rows enter the LLM. hidden (1, q, d): the
        block's embeddings; local (q,): their host indices in the prepared input. Returns sorted host int64 rows
        to keep, or None for all. Dropped rows never reach a decoder layer; kept ones keep their positions; only
        visual rows may go. A method may read the device once here (the rows decide the block's shapes), and may
        write into `hidden`'s kept visual rows in place (merged embeddings): it is the block's own tensor."""
        return None

    def after_layer(self, ctx: PrefillContext, state: LayerState) -> LayerState | None:
        """Called after every decoder layer of every block; may return a new state."""
        return None

    def end(self, ctx: PrefillContext) -> None:
        """Called once after the last block."""

    def report(self, ctx: PrefillContext) -> dict[str, Any]:
        return {}

    def config_dict(self) -> dict[str, Any]:
        """The method's name and options, as the report shows them (tuples as lists, like JSON)."""
        return {
            "method": self.name,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()},
        }
