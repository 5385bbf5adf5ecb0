"""Decoding with fixed shapes, replayed as one CUDA graph per token.

A decode step through `Engine.extend` is launch-bound on a GPU: a 7B model runs ~300 small kernels per token
with Python between them, so the GPU idles most of the time (~40 tokens/s measured on an H200, where reading the
weights once per token allows ~330). Fixing every shape of a step lets the whole step be captured once per answer
and replayed per token:

- each layer gets a fixed *window*: the entries it holds when the answer starts plus room for the answer,
  reserved before decoding, so no buffer moves while the graph holds its address;
- the new entry of step `s` is written at slot `held + s` (`CompressibleLayer.write_slot`), with `s` a device
  tensor the step itself increments, and attention reads the whole window while a mask hides the slots not
  written yet: the same entries a plain step attends to, in the same order;
- the token to feed is written into a device buffer before each replay (`fill_`, no host read).

Attention over the window (`SessionConfig.decode_attention`): "model" runs the model's own function (SDPA or eager)
with the mask; "grouped" sets `grouped_decode` in each layer call's step (`visualkv.attention.step`), so its attention runs
`packed_attention.one_query` (two batched matmuls, a float32 softmax, KV heads not repeated). Why: a mask keeps
PyTorch's SDPA off its flash kernels, and transformers packs a KV head's query heads as its queries, so on CUDA the
masked kernel may run one thread block per KV head, each streaming its head's whole window (reasoned from decode
rates, measured per kernel by scripts/decode_attention.py); `one_query` spreads the window over the GPU. "auto"
takes "grouped" on CUDA once the widest window holds `GROUPED_MIN_ENTRIES`, else "model". Each layer's packed
tiers (unchanged while an answer decodes) reach its attention call in the same step.

Every step that runs the layers in Python (the static steps, the graph's warm-up and capture) runs inside
`visualkv.attention.patched`; a graph replay runs no Python attention and needs none.

The token fed is a device tensor (the sampled id, never read back for the step); the host reads sampled ids every few
tokens (`visualkv.runtime.decode_loop`), and `rewind` forgets steps fed past an end of answer found at such a read.
The entries written are counted on the host once, when the answer ends (`finish`).

Modes (`SessionConfig.decode`):
- "graph": the step is captured as a CUDA graph (CUDA only, one device, SDPA or eager attention);
- "static": the same fixed-shape step run as plain PyTorch: on any device (the CPU tests compare it with "eager");
- "eager": `Engine.extend` per token, the shapes growing by one entry per token;
- "auto": "graph" where it applies, else "eager".
"""

from __future__ import annotations

import torch

from visualkv.attention import implementation, patched
from visualkv.attention import packed as packed_attention
from visualkv.attention import step as layer_step
from visualkv.kv.cache import CompressibleCache, CompressibleLayer
from visualkv.models.base import ModelAdapter
from visualkv.runtime.plan import attention_working_bytes

DECODE_MODES = ("auto", "eager", "static", "graph")
GRAPH_ATTENTION = ("sdpa", "eager")  # kernels that take an explicit mask (flash attention does not)
DECODE_ATTENTION = ("auto", "model", "grouped")
# "auto" takes "grouped" from this many entries in a layer's window (on CUDA): below it the masked kernel's few
# thread blocks still cover the window quickly and the grouped path's extra kernels would cost more. A first choice,
# not yet tuned on a GPU: `bench gpu --decode-attention-rows` and scripts/decode_attention.py measure both.
GROUPED_MIN_ENTRIES = 4096


def decode_attention(requested: str, device: torch.device, widest: int) -> str:
    """The attention a fixed-shape decoder runs ("model" or "grouped") for `requested` (DECODE_ATTENTION), the
    model's device and its widest window (entries per KV head)."""
    if requested != "auto":
        return requested
    return "grouped" if device.type == "cuda" and widest >= GROUPED_MIN_ENTRIES else "model"


def graph_unsupported(adapter: ModelAdapter) -> str | None:
    """Why a CUDA graph cannot decode on this model, or None when it can."""
    devices = {layer.input_layernorm.weight.device for layer in adapter.layers} | {adapter.device}
    if any(d.type != "cuda" for d in devices):
        return "CUDA graphs need the model on a CUDA device"
    if len(devices) > 1:
        return "the model is split over several devices"
    if (impl := implementation(adapter)) not in GRAPH_ATTENTION:
        return f"attention {impl!r} takes no mask (use sdpa or eager)"
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "CUDAGraph"):
        return "this PyTorch build has no CUDA graphs"
    return None


class StaticDecoder:
    """Runs the decode steps of one answer with fixed shapes (see the module docstring).

    Use: `logits = decoder.step(token)` per fed token, then `finish()` (always, also when the answer
    stops early): it counts the written entries as held and detaches from the cache.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        cache: CompressibleCache,
        steps: int,
        start_position: int,
        seq_offset: int,
        graph: bool,
        attention: str = "auto",
    ) -> None:
        self.adapter, self.cache, self.steps = adapter, cache, steps
        device = adapter.device
        self.held = [layer.static_window(steps) - steps for layer in cache.layers]  # host ints
        for i, layer in enumerate(cache.layers):  # reserving may have grown a buffer: count it once, now
            cache.refresh_bytes(i, layer.working_bytes)
        self.windows = [n + steps for n in self.held]
        self.ids = torch.zeros(1, dtype=torch.long, device=device)  # the token fed at the next step
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)  # steps run so far, on the device
        self.start_position = start_position
        self.seq_offset = seq_offset
        self.done = 0  # steps run (host count)
        # attention's transient over the widest window (the grouped-query expansion), as the plain path notes it,
        # plus the widest layer's packed tiers, dequantized by its attention call at every step
        packed = [layer.packed_working_bytes() for layer in cache.layers]
        n_packed = [layer.total_entries_per_head() - layer.n_full for layer in cache.layers]
        widest = max(w + p for w, p in zip(self.windows, n_packed))
        self.attention = decode_attention(attention, torch.device(device), max(self.windows))
        impl = implementation(adapter)
        if self.attention == "grouped":
            heads = adapter.text_config.num_attention_heads
            transient = packed_attention.one_query_working_bytes(heads, widest) + widest  # + the bool mask
        else:
            transient = attention_working_bytes(adapter, 1, widest, True, adapter.dtype, impl)
        cache.note_working(transient + max(packed))
        # one slot arange per distinct window (layers of one model usually share it)
        self._slots = {w: torch.arange(w, device=device) for w in set(self.windows)}
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self._slot_of: dict[int, torch.Tensor] = {}
        self._graph = None
        self._out: torch.Tensor | None = None
        self._eager_mask = impl == "eager"
        # what each layer's attention call takes beyond transformers' own arguments (the same every step)
        grouped = self.attention == "grouped" and impl in packed_attention.WRAPPED
        self._steps = [
            layer_step.Step(segments=layer.packed_segments(), grouped_decode=grouped) for layer in cache.layers
        ]
        cache.static = self
        if graph:
            try:
                self._capture()
            except Exception:
                cache.static = None
                raise

    # -- one step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self) -> torch.Tensor:
        """One decode step on device tensors only (what the graph captures)."""
        adapter = self.adapter
        hidden = adapter.embed(self.ids)
        positions = (self.step_index + self.start_position).view(1, 1).expand(adapter.position_axes, 1)
        cos, sin = adapter.rotary(hidden, positions)
        self._slot_of = {n: self.step_index + n for n in set(self.held)}
        self._masks = {}
        for layer_idx, layer in enumerate(adapter.layers):
            key = (self.held[layer_idx], self.windows[layer_idx])
            if key not in self._masks:
                self._masks[key] = self._mask(*key, hidden.dtype)
            with layer_step.running(self._steps[layer_idx]):
                hidden = layer(
                    hidden,
                    attention_mask=self._masks[key],
                    position_embeddings=(cos, sin),
                    past_key_values=self.cache,
                    use_cache=True,
                )
        logits = adapter.final_hidden_to_logits(hidden[:, -1:])[0, -1]
        self.step_index += 1
        return logits

    def _mask(self, held: int, window: int, dtype: torch.dtype) -> torch.Tensor:
        """(1, 1, 1, window): the held entries and those written by this answer so far, this step's included."""
        visible = (self._slots[window] <= self._slot_of[held]).view(1, 1, 1, window)
        if self._eager_mask:  # eager attention adds its mask to the scores
            return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
                ~visible, torch.finfo(dtype).min
            )
        return visible

    def update(
        self, layer: CompressibleLayer, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's `update` during a step: write the new entry in place, return the layer's window."""
        slot = self._slot_of[self.held[layer_idx]]
        token_index = self.step_index + self.seq_offset
        return layer.write_slot(key_states, value_states, token_index, slot, self.windows[layer_idx])

    # -- CUDA graph --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self) -> None:
        device = self.adapter.device
        stream = torch.cuda.Stream(device)  # captures need a stream other than the default one
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), patched(self.adapter):
            # warm-up outside the graph (lazy cuBLAS / kernel setup); it writes slot `held`, which step 0
            # writes again, and its step count is undone below
            self._run()
            self.step_index.zero_()
            # capture_begin / capture_end rather than `torch.cuda.graph(...)`, whose entry synchronises and
            # empties the allocator's cache (the next prefill would then allocate everything anew); thread_local:
            # the app serves several chats from threads, and another thread's CUDA calls must not void this capture
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._out = self._run()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        self._graph = graph

    # -- driving ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, token: int | torch.Tensor) -> torch.Tensor:
        """Feed `token` (the answer's latest: an id, or a one-element tensor on the model's device, as sampled);
        returns the next logits (valid until the next step)."""
        if self.done >= self.steps:
            raise RuntimeError(f"fixed-shape decoder sized for {self.steps} steps")
        if isinstance(token, torch.Tensor):
            self.ids.copy_(token.view(1))  # device to device: no host read
        else:
            self.ids.fill_(token)  # an async fill on the device: no host read
        self.done += 1
        if self._graph is not None:
            self._graph.replay()
            return self._out
        with patched(self.adapter):  # per step: a consumer that stops iterating leaves nothing patched
            return self._run()

    def rewind(self, n: int) -> None:
        """Forget the last `n` steps (tokens fed past the answer's end): `finish` does not count their entries, and
        the next step writes at the first of their slots, with the position and index that follow the kept steps.
        The slots after the step counter are masked, so what they still hold is never attended to."""
        if not 0 <= n <= self.done:
            raise ValueError(f"cannot rewind {n} of {self.done} steps")
        self.done -= n
        self.step_index.sub_(n)  # on the device, in place (a CUDA graph reads this tensor): no host read

    @property
    def mode(self) -> str:
        return "graph" if self._graph is not None else "static"

    def finish(self) -> None:
        """Count the entries written as held, and give the cache back its plain `update`."""
        self.cache.static = None
        for i, layer in enumerate(self.cache.layers):
            layer.commit_slots(self.done)
            self.cache.refresh_bytes(i)
        self._graph = self._out = None
