"""One attention call per chunk length in the Qwen vision towers, instead of one per chunk.

Qwen2.5-VL's vision tower attends inside 112-px windows in most layers, Qwen3-VL's (and the full-attention layers
of both) inside each image or temporal patch: `cu_seqlens` lists the chunks. Under SDPA or eager attention
transformers splits q / k / v per chunk and calls attention once per chunk in a Python loop (with a `tolist()` of
the chunk lengths per layer): a 4K image is ~660 windows x 28 windowed layers, some 20,000 attention calls, which
leaves a GPU idle most of the time. Here the chunks of one length are gathered into a batch and attended in one
call: a handful of calls per layer, the same arithmetic per chunk (scores never cross a chunk), and the chunk
lengths read on the host once per distinct `cu_seqlens` tensor (the tower passes the same two to every layer).

`batched_forward(module, groups)` is the forward `visualkv.attention.patched` gives each vision attention module
while it is entered; flash attention (varlen kernels) keeps transformers' own path.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from visualkv.devices import to_device

ATTENTION_CLASSES = ("Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention")

#: chunks per attention call at most: CUDA grids cap a launch dimension at 65,535 (batch, or batch x heads, by kernel)
MAX_CHUNKS_PER_CALL = 2048

#: distinct `cu_seqlens` tensors whose chunk groups are kept (a tower call makes two: windows and whole images)
CACHED_BOUNDARIES = 4


def vision_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward `batched_forward` replaces (the Qwen vision towers' attention)."""
    return [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES]


def _chunk_groups(cu_seqlens: torch.Tensor, cache: dict) -> list[tuple[int, list[torch.Tensor] | None]]:
    """[(length, the positions of its chunks on the device, one flat index per call; or None when the chunks tile
    the sequence in order)], one entry per chunk length.

    Reads the boundaries once per tensor and builds the indices on the host then: the tower builds two (windows,
    whole images) per forward and passes the same objects to every layer, which then only gathers. The cache
    keeps the tensor alive, so its id is not reused while cached.
    """
    hit = cache.get(id(cu_seqlens))
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1]
    bounds = cu_seqlens.tolist()  # one host read per distinct tensor (transformers' loop reads per layer)
    starts_by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    groups: list[tuple[int, list[torch.Tensor] | None]] = []
    for length, starts in starts_by_length.items():
        if len(starts_by_length) == 1 and starts[0] == 0:  # equal chunks in order: a reshape, no gather
            groups.append((length, None))
            continue
        positions = (torch.tensor(starts)[:, None] + torch.arange(length)).flatten()
        per_call = MAX_CHUNKS_PER_CALL * length
        calls = [to_device(positions[i : i + per_call], cu_seqlens.device) for i in range(0, len(positions), per_call)]
        groups.append((length, calls))
    if len(cache) >= CACHED_BOUNDARIES:  # list(): one step under the GIL, safe while another thread inserts
        for stale in list(cache)[: len(cache) - CACHED_BOUNDARIES + 1]:
            cache.pop(stale, None)
    cache[id(cu_seqlens)] = (cu_seqlens, groups)
    return groups


def _attend_chunks(module, q, k, v, groups) -> torch.Tensor:
    """q / k / v (seq, heads, dim); attention inside each chunk, one call per group (per slice of at most
    `MAX_CHUNKS_PER_CALL` chunks); returns (seq, heads, dim)."""
    own = sys.modules[type(module).__module__]  # the class's modeling module: its eager attention is the default
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, own.eager_attention_forward)

    def attend(batch: list[torch.Tensor]) -> torch.Tensor:
        # (chunks, length, heads, dim) in and out, as transformers' interfaces return it
        qkv = [t.transpose(1, 2) for t in batch]
        return interface(module, *qkv, attention_mask=None, scaling=module.scaling, dropout=0.0, is_causal=False)[0]

    out = q.new_empty(q.shape)
    for length, indices in groups:
        if indices is None:  # equal chunks tiling the sequence: views, no gather
            n = q.shape[0] // length
            views = [t.view(n, length, *t.shape[1:]) for t in (q, k, v, out)]
            for i in range(0, n, MAX_CHUNKS_PER_CALL):
                views[3][i : i + MAX_CHUNKS_PER_CALL] = attend([t[i : i + MAX_CHUNKS_PER_CALL] for t in views[:3]])
            continue
        for index in indices:  # made once per `cu_seqlens` (`_chunk_groups`): each layer only gathers
            batch = [t[index].view(-1, length, *t.shape[1:]) for t in (q, k, v)]
            out[index] = attend(batch).reshape(-1, *q.shape[1:])
    return out


def batched_forward(module: torch.nn.Module, chunk_groups: dict) -> Callable[..., torch.Tensor]:
    """`module`'s forward with chunks batched by length (transformers' own under flash attention).

    chunk_groups: where the chunk groups of the last few `cu_seqlens` are kept (owned by the caller's patch).
    """
    cls = type(module)
    apply_rotary = sys.modules[cls.__module__].apply_rotary_pos_emb_vision  # the class's own module

    def forward(hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        if "flash" in (module.config._attn_implementation or ""):
            return cls.forward(module, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        seq_length = hidden_states.shape[0]
        qkv = module.qkv(hidden_states).reshape(seq_length, 3, module.num_heads, -1).permute(1, 0, 2, 3)
        q, k, v = qkv.unbind(0)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        out = _attend_chunks(module, q, k, v, _chunk_groups(cu_seqlens, chunk_groups))
        return module.proj(out.reshape(seq_length, -1).contiguous())

    return forward
