"""Evidence recall: how much of what the uncompressed model looked at to answer survived compression.

For a finished turn, the conversation up to the answer is run again through the UNCOMPRESSED model (a `full`
prefill, block by block at the family's default block size, into a scratch cache: never more than `full`'s cache,
and the memory guard checks it first), then the compressed model's answer is teacher-forced. At every layer the
queries that produce the answer's first `EVIDENCE_TOKENS` tokens (the last context token, then the answer's own
tokens before the last of them) attend to every key; their attention on each visual token, summed over the query
heads and the queries, is the evidence map. `evidence_recall` is the share of that mass on visual tokens the
compressed cache still holds, per KV head (a query head's mass counts against the KV head it reads):

- a token LightKV merged counts as held where the token it merged into is held;
- Sali-Cache's pruned tokens and skipped frames are lost, its INT8 / INT4 tiers held.

The pass runs inside `patched` (the engine's layer loop), touches nothing of the model, and works one layer and
one KV head group at a time, so its only transient beyond the scratch cache is one group's probabilities.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from visualkv.kv.cache import CompressibleCache
from visualkv.methods.base import LayerState, Method
from visualkv.methods.full import FullCache
from visualkv.report.telemetry import BlockEvent
from visualkv.runtime.engine import Engine

#: answer tokens whose producing queries are read (all of them when the answer is shorter)
EVIDENCE_TOKENS = 16


@dataclass
class Evidence:
    """One turn's evidence: recall overall and per layer, and the map.

    map_per_layer: (layers, visual tokens) each layer's visual attention mass as shares (a row sums to 1).
    visual_share_per_layer: per layer, the share of the queries' attention (mean over query heads and queries)
      that falls on visual tokens at all.
    """

    recall: float
    recall_per_layer: list[float]
    map_per_layer: np.ndarray
    queries: int
    seconds: float
    visual_share_per_layer: list[float]

    @property
    def map(self) -> np.ndarray:
        """(visual tokens,) the map averaged over layers."""
        return self.map_per_layer.mean(axis=0) if self.map_per_layer.size else np.zeros(0)

    def report(self, max_values: int) -> dict[str, Any]:
        """The JSON report's `evidence` field; the per-layer map only up to `max_values` values."""
        out: dict[str, Any] = {
            "recall": self.recall,
            "recall_per_layer": [round(r, 6) for r in self.recall_per_layer],
            "map_shape": list(self.map_per_layer.shape),
            "map": self.map.round(6).tolist(),
            "visual_share_per_layer": [round(v, 6) for v in self.visual_share_per_layer],
            "queries": self.queries,
            "seconds": self.seconds,
        }
        if self.map_per_layer.size <= max_values:
            out["map_per_layer"] = self.map_per_layer.round(5).tolist()
        return out


def held_by_layer(cache: CompressibleCache, n_visual: int, visual_ids: torch.Tensor, owner) -> list[torch.Tensor]:
    """Per layer, (KV heads, n_visual) bool on the layer's device: which visual tokens the compressed cache holds
    on each head, every precision tier counted; `owner` (n_visual,) maps a token LightKV merged to the token that
    absorbed it (None: nothing merged). `visual_ids`: visual id (or -1) of each global index, the last slot for
    every index past the media input."""
    out = []
    for layer in cache.layers:
        index = layer.all_token_index()[0].long()  # (heads, n), every tier
        held = torch.zeros((index.shape[0], n_visual + 1), dtype=torch.bool, device=index.device)
        table = visual_ids.to(index.device)
        ids = table[index.clamp(max=table.shape[0] - 1)]
        held.scatter_(1, torch.where(ids >= 0, ids, n_visual), True)
        held = held[:, :n_visual]
        if owner is not None:
            held = held | held[:, torch.as_tensor(owner, device=held.device)]
        out.append(held)
    return out


class _EvidenceObserver(Method):
    """After each layer of the teacher-forced pass: the queries' attention on the visual tokens, per KV head."""

    def __init__(self, adapter, cache, visual_ids: torch.Tensor, n_visual: int, held: list[torch.Tensor]) -> None:
        self.adapter, self.cache, self.visual_ids, self.n_visual, self.held = adapter, cache, visual_ids, n_visual, held
        self.kept: list[torch.Tensor] = []  # per layer, device scalars: read once after the pass
        self.total: list[torch.Tensor] = []
        self.maps: list[torch.Tensor] = []

    def after_layer(self, ctx, state: LayerState) -> None:
        i, adapter = state.layer_idx, self.adapter
        queries = adapter.query_states(i, state.hidden_in, state.cos, state.sin)[0].float()  # (hq, q, d)
        layer = self.cache.layers[i]
        keys, index = layer.keys[0], layer.token_index[0].long()  # (hkv, n, d), (hkv, n): the whole context
        query_index = index[0, -queries.shape[1] :]  # the pass's own entries come last, in order
        scale = getattr(adapter.layers[i].self_attn, "scaling", adapter.head_dim**-0.5)
        table = self.visual_ids.to(keys.device)
        group = adapter.query_group
        mass = torch.zeros((keys.shape[0], self.n_visual + 1), dtype=torch.float32, device=keys.device)
        for head in range(keys.shape[0]):  # one KV head group at a time: the transient stays one group's
            logits = queries[head * group : (head + 1) * group] @ keys[head].float().T * scale  # (group, q, n)
            future = index[head][None, :] > query_index[:, None]  # causal: a query sees its past only
            probs = logits.masked_fill(future, float("-inf")).softmax(-1)
            ids = table[index[head].clamp(max=table.shape[0] - 1)]
            mass[head].index_add_(0, torch.where(ids >= 0, ids, self.n_visual), probs.sum((0, 1)))
            self.cache.note_working(3 * probs.nbytes)
        visual = mass[:, : self.n_visual]
        held = self.held[i].to(visual.device)
        total = visual.sum()
        self.total.append(total)
        self.kept.append(total - torch.where(held, 0.0, visual).sum())  # nothing lost: exactly the total
        self.maps.append(visual.sum(0))


@dataclass
class _Context:
    """What the uncompressed pass replays: the prepared input, the text after it, and the pass's own tokens."""

    prepared: Any
    text: torch.Tensor | None  # text run after the media input before the pass (follow-up turns), or None
    ids: torch.Tensor  # the pass: last context token, then the answer's tokens before its last
    positions: torch.Tensor  # (P, q)
    token_index: torch.Tensor  # (q,) global indices


def _replay(session, queries: int) -> _Context:
    """The conversation up to the last turn's answer, split as the pass runs it (see `ChatSession`)."""
    prepared, record = session.prepared, session.turns[-1]
    history_len, seq_start, next_position = session.answer_start
    answer = torch.tensor(record.token_ids[: queries - 1], dtype=torch.long)
    axes = prepared.position_ids.shape[0]
    if history_len == 0:  # the last context token is the prepared input's own: kept out of the prefill
        keep = torch.ones_like(prepared.keep)
        keep[-1] = False
        replayed = dataclasses.replace(prepared, keep=keep)
        last = prepared.input_ids[-1:].long()
        text = None
    else:
        replayed = dataclasses.replace(prepared, keep=torch.ones_like(prepared.keep))
        history = torch.cat(session.history_ids[:history_len]).long()
        last, text = history[-1:], history[:-1] if history.shape[0] > 1 else None
    start = next_position - 1
    positions = (torch.arange(queries) + start).view(1, -1).expand(axes, queries)
    if history_len == 0:
        positions = torch.cat([prepared.position_ids[:, -1:].long(), positions[:, 1:]], dim=1)
    return _Context(replayed, text, torch.cat([last, answer]), positions, torch.arange(queries) + seq_start - 1)


def compute_evidence(
    session,
    on_block: Callable[[BlockEvent], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Evidence | None:
    """The evidence of `session`'s last turn (a `ChatSession` with a finished turn); None without visual tokens.

    on_block: the uncompressed prefill's block events (progress); should_stop: asked as in any prefill.
    """
    t0 = time.perf_counter()
    adapter, prepared = session.adapter, session.prepared
    n_visual = prepared.layout.n_visual if prepared is not None else 0
    if n_visual == 0 or session.cache is None or not session.turns:
        return None
    queries = max(1, min(EVIDENCE_TOKENS, len(session.turns[-1].token_ids)))
    replay = _replay(session, queries)
    block_size = adapter.default_block_size
    session.guard.check_evidence(adapter, replay.prepared, session.config, queries, block_size)
    ids = torch.from_numpy(prepared.layout.visual_id_of_seq(prepared.seq_len + 1))  # last slot -1: after the media
    report = session.method.report(session.prefill_result.context) if session.prefill_result is not None else {}
    owner = report.get("merge_map")
    held = held_by_layer(session.cache, n_visual, ids, owner)
    cache = CompressibleCache(adapter.num_layers, headroom=queries + 1, query_group=adapter.query_group)
    engine = Engine(adapter)
    engine.prefill(
        replay.prepared, cache, FullCache(), None, block_size, "blockwise", on_block=on_block, should_stop=should_stop
    )
    if replay.text is not None:  # the conversation before the answer, into the scratch cache: Stop holds
        engine.extend(replay.text, prepared.next_position, prepared.seq_len, cache, should_stop=should_stop)
    observer = _EvidenceObserver(adapter, cache, ids, n_visual, held)
    with engine.stoppable(should_stop):
        engine.run_layers(adapter.embed(replay.ids), replay.positions, replay.token_index, cache, observer)
    # one host read for the whole pass, after its last layer: the figures are what the caller asked for
    kept = torch.stack([k.cpu() for k in observer.kept]).double()
    total = torch.stack([t.cpu() for t in observer.total]).double()
    maps = torch.stack([m.cpu() for m in observer.maps]).double()
    per_layer = torch.where(total > 0, kept / total.clamp(min=1e-300), torch.ones_like(total))
    recall = float(kept.sum() / total.sum()) if float(total.sum()) > 0 else 1.0
    shares = (maps / total.clamp(min=1e-300)[:, None]).numpy().astype(np.float32)
    del cache
    visual_share = (total / (queries * adapter.text_config.num_attention_heads)).tolist()
    return Evidence(recall, per_layer.tolist(), shares, queries, time.perf_counter() - t0, visual_share)
