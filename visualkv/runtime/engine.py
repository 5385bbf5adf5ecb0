"""Prefill driver (bulk / block-wise / hybrid) and single decode steps.

The engine runs the decoder layers itself, one block at a time:

    for block in plan_blocks(...):
        embeddings of the block's tokens (text embedding, or the vision tower
          run on just this block's tiles / rows / frames)
        the method's `select_rows`: visual rows it drops never enter the LLM
        for each decoder layer: attend to cache ∪ block, append, then let the
          method evict / merge for that layer
        emit a BlockEvent (bytes, entries, RSS, seconds)

So neither the full visual embedding sequence nor the full KV cache ever
exists in a block-wise prefill. Positions come from the prepared input's table
(computed once over the uncompressed sequence), so kept entries keep their
original positions and new tokens continue the original numbering.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from visualkv.attention import implementation, patched
from visualkv.attention import packed as packed_attention
from visualkv.attention import step as layer_step
from visualkv.attention.block import AfterCache
from visualkv.devices import to_device
from visualkv.errors import ConfigError, stop_point, stop_scope
from visualkv.kv.cache import TIER_FULL, CompressibleCache, split_tiers
from visualkv.layout import Block
from visualkv.methods.base import LayerState, Method, PrefillContext
from visualkv.models.base import LayerFeatures, ModelAdapter, PreparedInput
from visualkv.report.telemetry import BlockEvent, cuda_allocated, rss_bytes
from visualkv.runtime.plan import attention_working_bytes, needs_mask, plan_prefill

BlockCallback = Callable[[BlockEvent], None]


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (vocab,) logits of the last prompt token
    blocks: list[BlockEvent]
    context: PrefillContext
    seconds: float


def attention_mask(q: int, n_past: int, impl: str, device) -> AfterCache | torch.Tensor | None:
    """Mask for q new tokens after n_past cached entries (all of which are older).

    Every cached entry is visible, whatever was evicted; the block itself is causal. One query token needs no
    mask, nor does a first block under an SDPA-like kernel (its own causal flag is used, as transformers does).
    `impl`: the model's own kernel. Inside `patched`, sdpa and eager run VisualKV's functions (`packed_attention`),
    which take the `AfterCache` marker from the layer call's step (sdpa then attends without expanding K/V,
    `block_attention`); any other kernel gets the bool mask as its attention mask.
    """
    if not needs_mask(q, n_past, impl):
        return None  # SDPA-like kernels then run causally without materialising a mask
    marker = AfterCache(q)
    return marker if impl in packed_attention.WRAPPED else marker.dense(n_past + q, device)


class BlockPlan:
    """What the layers of one block need from its host-side token indices, computed once on the host; `step`
    makes a layer call's `Step` (the one channel to the cache and attention) from it.

    index_on(device): the block's token indices on a layer's device (copied once per device).
    tier_split: {tier: positions} or None (all full precision), see `split_tiers`.
    n_visual_full: visual tokens among the block's full-precision entries (for eviction's count).
    """

    def __init__(
        self,
        token_index: torch.Tensor,
        tiers: torch.Tensor | None,
        ctx: PrefillContext | None,
        n_visual: int | None = None,
        tier_split: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.token_index = token_index
        # a method that reshaped the block may hand its split over (made on the device, no host read)
        self.tier_split = tier_split if tier_split is not None or n_visual is not None else split_tiers(tiers)
        self._on: dict = {}  # device -> token indices there; ("tiers", device) -> tier positions there
        if n_visual is not None or ctx is None:
            self.n_visual_full = n_visual or 0
            return
        visual = ctx.is_visual(token_index.cpu())
        if self.tier_split is not None:
            full = self.tier_split.get(TIER_FULL)
            visual = visual[full] if full is not None else visual[:0]
        self.n_visual_full = int(visual.sum())

    def index_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = to_device(self.token_index.to(torch.int32), device)
        return self._on[device]

    def tiers_on(self, device: torch.device) -> dict[int, torch.Tensor] | None:
        if self.tier_split is None:
            return None
        key = ("tiers", device)
        if key not in self._on:
            self._on[key] = {tier: to_device(sel, device) for tier, sel in self.tier_split.items()}
        return self._on[key]

    def step(self, device: torch.device, segments: list, after_cache: AfterCache | None) -> layer_step.Step:
        """The step of a layer on `device` holding the packed `segments` (taken before the layer runs)."""
        return layer_step.Step(self.index_on(device), self.tiers_on(device), self.n_visual_full, segments, after_cache)


def kept_units(prepared: PreparedInput, block: Block) -> list:
    """The block's units with at least one kept token: those the vision tower sees (skipped frames never do)."""
    return [u for u in block.units if bool(prepared.keep[u.seq_start : u.seq_end].any())]


def select_rows(
    method: Method, ctx: PrefillContext, hidden: torch.Tensor, local: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's embeddings (1, q', d) and host indices (q',) of the rows `method.select_rows` keeps (all where it
    returns None); ValueError if it dropped a protected (non-visual) token. Layer features of dropped rows stay
    with the block: `LayerFeatures.add_after_layer` adds nothing for a token no longer in it."""
    rows = method.select_rows(ctx, hidden, local)
    if rows is None:
        return hidden, local
    kept = torch.zeros(local.numel(), dtype=torch.bool)
    kept[rows] = True
    if bool((~kept & ~ctx.prepared.visual_mask[local]).any()):
        raise ValueError(f"{method.name} dropped protected tokens before the LLM; only visual rows may be dropped")
    return hidden.index_select(1, to_device(rows, hidden.device)), local[rows]


def _latest_frame_time(frames, units, so_far: float | None) -> float | None:
    """The time (s) of the latest video frame among a block's units (skipped frames count: the prefill
    has read past them), else `so_far`; None while no video frame was reached. Host data only."""
    times = [frames[u.frame].time for u in units if frames[u.frame].kind == "frame"]
    return max(times) if times and (so_far is None or max(times) > so_far) else so_far


@contextlib.contextmanager
def _vision_stops(adapter: ModelAdapter, should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, every block of the model's stacks outside the decoder (the vision tower's; `run_layers`
    asks before each decoder layer), and each of its parts, asks `stop_point` before it runs, so a bulk prefill's
    one vision call over a long video ends at Stop within a vision block's step. Hooks that only read a Python
    flag, removed on exit."""
    if should_stop is None:
        yield
        return
    decoder = {id(m) for m in adapter.layers.modules()}
    stacks = [m for m in adapter.model.modules() if isinstance(m, torch.nn.ModuleList) and id(m) not in decoder]
    inside = {id(m): m for stack in stacks for block in stack for m in block.modules()}  # each block's parts too
    handles = [module.register_forward_pre_hook(_stop_hook) for module in inside.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _layer_part_stops(adapter: ModelAdapter, should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, each decoder layer's parts (its attention, its MLP) ask `stop_point` before they run, so
    a long text pass or block ends at Stop or the time limit within a part of a layer, not a whole layer. Hooks
    that only read a Python flag, removed on exit."""
    if should_stop is None:
        yield
        return
    handles = [part.register_forward_pre_hook(_stop_hook) for layer in adapter.layers for part in layer.children()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _stop_hook(module: torch.nn.Module, args: tuple) -> None:
    stop_point()


def _inside_patch(run: Callable) -> Callable:
    """An `Engine` method run inside `patched(self.adapter)` (entered once; nested entries only count)."""

    @functools.wraps(run)
    def wrapper(self: Engine, *args, **kwargs):
        with patched(self.adapter):
            return run(self, *args, **kwargs)

    return wrapper


class Engine:
    """Runs blocks of tokens through the LLM with a `CompressibleCache`.

    What runs the model (`prefill`: the vision tower and the layers; `run_layers`, which `text_pass` and `extend`
    call) does so inside `visualkv.attention.patched`: the model is as its owner left it whenever none runs.
    """

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter

    # -- the layer loop -------------------------------------------------------------
    @_inside_patch
    @torch.no_grad()
    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        token_index: torch.Tensor,
        cache: CompressibleCache,
        method: Method | None = None,
        ctx: PrefillContext | None = None,
        tiers: torch.Tensor | None = None,
        layer_features: LayerFeatures | None = None,
    ) -> torch.Tensor:
        """hidden (1, q, d) through every decoder layer; returns the last hidden states.

        token_index / tiers are host tensors. Everything the layers need from them (device copies, the
        tier split, the visual count, masks) is prepared on the host once per block (`BlockPlan`), so
        the layer loop itself never reads the device (no host synchronisation).
        layer_features: the block's DeepStack-style additions, added after their layers (before the
        method sees the layer's output, as they are part of the model's own layer output).
        Runs inside `patched`; each layer runs inside its `Step` (`visualkv.attention.step`): the new entries'
        indices and tiers for the cache, the layer's packed tiers and the block's mask for attention.
        """
        adapter = self.adapter
        impl = implementation(adapter)
        cos, sin = adapter.rotary(hidden, positions)
        plan = BlockPlan(token_index, tiers, ctx)
        masks: dict[tuple, AfterCache | torch.Tensor | None] = {}
        for layer_idx, layer in enumerate(adapter.layers):
            if ctx is not None:  # a prefill's layer (bulk: the whole media in one block) ends at Stop
                ctx.stop_if_asked()
            device = layer.input_layernorm.weight.device
            hidden, cos, sin = hidden.to(device), cos.to(device), sin.to(device)
            cache_layer = cache.layers[layer_idx]
            q, n_past = hidden.shape[1], cache_layer.get_seq_length()  # host ints
            key = (q, n_past, device)
            if key not in masks:  # one mask per block (per distinct cache length and device)
                masks[key] = attention_mask(q, n_past, impl, device)
            mask = masks[key]
            after = mask if isinstance(mask, AfterCache) else None  # the wrapped functions take it from the step
            # the packed segments held before this block: what its attention call adds
            with layer_step.running(plan.step(device, cache_layer.packed_segments(), after)):
                out = layer(
                    hidden,
                    attention_mask=None if after is not None else mask,
                    position_embeddings=(cos, sin),
                    past_key_values=cache,
                    use_cache=True,
                )
            cache.note_working(attention_working_bytes(adapter, q, n_past + q, mask is None, hidden.dtype, impl))
            if layer_features is not None:
                out = layer_features.add_after_layer(layer_idx, out, token_index)
            if method is not None:
                state = LayerState(layer_idx, hidden, out, positions, token_index, cos, sin, tiers)
                new = method.after_layer(ctx, state)
                if new is not None:
                    out, positions, token_index, cos, sin, tiers = (
                        new.hidden,
                        new.positions,
                        new.token_index,
                        new.cos,
                        new.sin,
                        new.tiers,
                    )
                    plan = BlockPlan(token_index, tiers, ctx, new.n_visual, new.tier_split)
            hidden = out
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.adapter.final_hidden_to_logits(hidden[:, -1:])[0, -1]

    # -- prefill --------------------------------------------------------------------
    def block_embeddings(
        self, prepared: PreparedInput, block: Block, encoded: list[int] | None = None, seq_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, LayerFeatures | None]:
        """(1, q, d) embeddings of the block's kept tokens, their local indices (q,) and the kept visual
        tokens' per-layer features (DeepStack; None for families without), indexed by `seq_offset + local`.

        Units none of whose tokens are kept (skipped frames) never reach the
        vision tower; `encoded` collects the frame/tile index of each unit sent.
        """
        local = torch.arange(block.start, block.end)
        keep = prepared.keep[block.start : block.end]
        local = local[keep]
        ids = prepared.input_ids[local]
        hidden = self.adapter.embed(ids)
        units = kept_units(prepared, block)
        layer_features = None
        if units:
            if encoded is not None:
                encoded.extend(u.frame for u in units)
            # (n_unit_tokens, d), all tokens of those units, and any per-layer features of the same tokens
            visual, per_layer = self.adapter.encode_units_with_layer_features(prepared, units)
            unit_idx = torch.cat([torch.arange(u.seq_start, u.seq_end) for u in units])
            kept = prepared.keep[unit_idx].nonzero().flatten()  # host indices: no device-side mask to size
            visual, unit_idx = visual.index_select(0, to_device(kept, visual.device)), unit_idx[kept]
            where = torch.searchsorted(local, unit_idx)
            hidden[0, to_device(where, hidden.device)] = visual.to(hidden.device, hidden.dtype)
            if per_layer:
                picked = [f.index_select(0, to_device(kept, f.device)) for f in per_layer]
                layer_features = LayerFeatures(unit_idx + seq_offset, picked)
        return hidden, local, layer_features

    @_inside_patch
    @torch.no_grad()
    def prefill(
        self,
        prepared: PreparedInput,
        cache: CompressibleCache,
        method: Method,
        budget: int | None,
        block_size: int | None = None,
        prefill_mode: str | None = None,
        seq_offset: int = 0,
        on_block: BlockCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        vision_ahead: int = 1,
    ) -> PrefillResult:
        """Run the whole prepared input into `cache` under `method`.

        `should_stop` is asked before every block, before every decoder layer of a block (a bulk prefill is
        one block), before every vision-tower block and chunk of video preparation (`stop_scope`), by the
        method's own passes over the media (`PrefillContext.stop_if_asked`) and once after the last block: when
        it says yes, `PrefillStopped` is raised and `cache` must be discarded.
        `vision_ahead`: the media of this many blocks go through the vision tower in one call (each block's
        own strip or frames a separate sequence there, so the embeddings are those of one call per block),
        held until their blocks run: fewer tower entries (kernel launches) for a larger transient; adapters
        without `encode_ahead` encode block by block whatever it says.
        """
        with (
            stop_scope(should_stop),
            _vision_stops(self.adapter, should_stop),
            _layer_part_stops(self.adapter, should_stop),
        ):
            return self._prefill(
                prepared,
                cache,
                method,
                budget,
                block_size,
                prefill_mode,
                seq_offset,
                on_block,
                should_stop,
                vision_ahead,
            )

    def _prefill(
        self,
        prepared: PreparedInput,
        cache: CompressibleCache,
        method: Method,
        budget: int | None,
        block_size: int | None,
        prefill_mode: str | None,
        seq_offset: int,
        on_block: BlockCallback | None,
        should_stop: Callable[[], bool] | None,
        vision_ahead: int,
    ) -> PrefillResult:
        t_start = time.perf_counter()
        plan = plan_prefill(self.adapter, prepared, method, budget, block_size, prefill_mode, vision_ahead)
        ctx = PrefillContext(self.adapter, cache, prepared, budget, plan.block_size, plan.mode, seq_offset)
        ctx.should_stop = should_stop
        ctx.text_pass = lambda ids, positions, observer: self.text_pass(ids, positions, observer, ctx)
        self.adapter.reset_stream()
        ctx.blocks = plan.blocks  # before `begin`, so a method can plan per block (LightKV's windows)
        method.begin(ctx)
        if ctx.tiers is not None and (impl := implementation(self.adapter)) not in packed_attention.WRAPPED:
            raise ConfigError(
                f"INT8/INT4 tiers need sdpa or eager attention; this model runs {impl!r}"
                " (load it with attn_implementation='sdpa', or choose a method without tiers)"
            )
        cache.set_capacity_hint(method.capacity_hint(ctx))
        for device in {layer.input_layernorm.weight.device for layer in self.adapter.layers}:
            ctx.visual_by_index_on(device)  # copied once, before any layer needs it
        events: list[BlockEvent] = []
        last_hidden = None
        media_seconds = None  # time of the latest video frame reached so far (None: no video frame yet)
        tower_calls = plan.tower_calls()  # block -> the blocks whose media one tower call encodes ahead there
        try:
            for i, block in enumerate(ctx.blocks):
                ctx.stop_if_asked()
                t0 = time.perf_counter()
                ctx.block = block
                if i in tower_calls:
                    self.adapter.encode_ahead(prepared, [kept_units(prepared, ctx.blocks[j]) for j in tower_calls[i]])
                hidden, local, layer_features = self.block_embeddings(prepared, block, ctx.encoded_frames, seq_offset)
                hidden, local = select_rows(method, ctx, hidden, local)
                if local.numel():  # a block whose every row was dropped runs no layer, but is reported like any
                    tiers = ctx.tiers[local] if ctx.tiers is not None else None
                    last_hidden = self.run_layers(
                        hidden,
                        prepared.position_ids[:, local],
                        local + seq_offset,
                        cache,
                        method,
                        ctx,
                        tiers,
                        layer_features,
                    )
                media_seconds = _latest_frame_time(prepared.layout.frames, block.units, media_seconds)
                per_layer = cache.entries_per_layer()
                event = BlockEvent(
                    index=len(events),
                    kind=block.kind,
                    tokens_in=int(local.numel()),
                    visual_tokens_in=int(prepared.visual_mask[local].sum()),
                    kv_tokens=max(per_layer),
                    kv_tokens_per_layer=per_layer,
                    kv_bytes=cache.kv_bytes(),
                    peak_kv_bytes=cache.peak_kv_bytes,
                    rss_bytes=rss_bytes(),
                    seconds=time.perf_counter() - t0,
                    cuda_allocated_bytes=cuda_allocated(),
                    n_blocks=len(ctx.blocks),
                    media_seconds=media_seconds,
                )
                events.append(event)
                if on_block is not None:
                    on_block(event)
        except BaseException:  # stopped or failed: nothing encoded ahead (nor a buffered strip) outlives it
            self.adapter.reset_stream()
            raise
        ctx.stop_if_asked()
        if last_hidden is None:
            raise ValueError("nothing to prefill: every token was dropped")
        method.end(ctx)
        if events:  # a post-prefill method compressed after the last block: its record shows the result
            per_layer = cache.entries_per_layer()
            events[-1].kv_tokens, events[-1].kv_tokens_per_layer = max(per_layer), per_layer
            events[-1].kv_bytes = cache.kv_bytes()
        self.adapter.reset_stream()
        logits = self.logits(last_hidden)
        return PrefillResult(logits, events, ctx, time.perf_counter() - t_start)

    @torch.no_grad()
    def text_pass(self, ids: torch.Tensor, positions: torch.Tensor, observer: Method, ctx: PrefillContext) -> None:
        """Run text tokens through every layer in a scratch cache; `observer.after_layer` sees each layer.

        The service behind `PrefillContext.text_pass`: SnapKV's proxy queries and LightKV's question states
        come from such a pass over [prompt prefix + question] before the media blocks.
        """
        scratch = CompressibleCache(self.adapter.num_layers)
        self.run_layers(self.adapter.embed(ids), positions, torch.arange(ids.shape[0]), scratch, observer, ctx)

    @contextlib.contextmanager
    def stoppable(self, should_stop: Callable[[], bool] | None) -> Iterator[None]:
        """Within the block, `should_stop` is asked before each part of each decoder layer (`PrefillStopped`): for a
        pass over text into a cache its caller drops when stopped (a follow-up's replay of the conversation, the
        Evidence pass), however long the text. Nothing is hooked when it is None."""
        if should_stop is None:
            yield
            return
        with stop_scope(should_stop), _layer_part_stops(self.adapter, should_stop):
            stop_point()
            yield

    @torch.no_grad()
    def extend(
        self,
        ids: torch.Tensor,
        start_position: int,
        seq_offset: int,
        cache: CompressibleCache,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Run plain text tokens (protected) after the cache; returns last logits. `should_stop`: see `stoppable`
        (the cache is then half-extended: only for a cache the caller drops when stopped)."""
        with self.stoppable(should_stop):
            return self._extend(ids, start_position, seq_offset, cache)

    def _extend(
        self, ids: torch.Tensor, start_position: int, seq_offset: int, cache: CompressibleCache
    ) -> torch.Tensor:
        n = int(ids.shape[0])
        device = self.adapter.device  # positions and indices made there: no host-to-device copy per token
        steps = torch.arange(n, device=device)
        positions = (steps + start_position).view(1, n).expand(self.adapter.position_axes, n)
        hidden = self.adapter.embed(ids)
        hidden = self.run_layers(hidden, positions, steps + seq_offset, cache)
        return self.logits(hidden)
