"""ChatSession: multi-turn chat over one image or video with a compressed cache.

Turn 1 prefills the media and the question under the chosen method; later
turns append their text to the same (compressed) cache, continuing the
original position numbering. Answers stream piece by piece, as the decoded tokens are read back
(`SessionConfig.decode_read_every`).

Follow-up questions and query-aware eviction: SnapKV keeps what the *first*
question attended to. A follow-up about another part of the media may find its
evidence gone, and the model then answers from what is left. Two remedies:
a query-agnostic method (`blockwise-keydiff`), or `followup="reprefill"`,
which rebuilds the media cache with the new question as the proxy (costs a
second prefill; the conversation so far is replayed as text).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from PIL import Image

from visualkv.attention import block as block_attention
from visualkv.attention import implementation
from visualkv.errors import ConfigError, PrefillStopped, VisualKVError, check_range, stop_point, stop_scope
from visualkv.kv.cache import CompressibleCache
from visualkv.media import Media, load_image, load_media
from visualkv.methods import make_method, method_traits
from visualkv.methods.base import Method
from visualkv.models.base import ModelAdapter, PreparedInput
from visualkv.report.telemetry import (
    CUDA_PEAK_SCOPE,
    BlockEvent,
    TurnRecord,
    cuda_peak,
    peak_rss_bytes,
    reset_cuda_peak,
)
from visualkv.runtime.decode_loop import DecodeLimits, DecodeLoop, Feeder, read_interval
from visualkv.runtime.detokenize import IncrementalDetokenizer
from visualkv.runtime.engine import Engine, PrefillResult
from visualkv.runtime.evidence import Evidence, compute_evidence
from visualkv.runtime.frame_cap import media_limits
from visualkv.runtime.memory_guard import MemoryEstimate, MemoryGuard
from visualkv.runtime.park import PARK_MODES, ParkStats, park, resolve_park, unpark
from visualkv.runtime.static_decode import DECODE_ATTENTION, DECODE_MODES, StaticDecoder, graph_unsupported


def model_info(adapter: ModelAdapter) -> dict[str, Any]:
    """The report's model description, naming the model's own attention kernel (also while `patched` is on)."""
    return adapter.describe() | {"attn_implementation": implementation(adapter)}


@dataclass
class SessionConfig:
    """Everything that decides how a conversation is compressed and decoded.

    method: one of visualkv.methods.method_names(): a single method or a composition such as
      "blockwise-keydiff+salicache" (stages joined with "+", see visualkv.methods.compose).
    budget: visual KV entries kept per layer and per KV head (M); required by
      eviction methods (unless `keep` is given), ignored by `full`.
    keep: the budget as a share of the media's visual tokens, in (0, 1] (0.1 keeps 10 %): once the media is
      prepared, `budget` becomes round(keep × visual tokens), at least 1, before the memory guard and the
      prefill see it (`resolved`); None = `budget` as given.
    block_size: visual tokens per block (b); None = the model's default
      (784 for Qwen2.5-VL, 256 for SmolVLM).
    prefill: "hybrid", "blockwise" or "bulk"; None = the method's default.
    max_new_tokens: answer length cap per turn.
    temperature: 0 = greedy; otherwise sampling with `top_p`.
    seed: sampling seed (per turn: seed + turn index).
    followup: "reuse" (keep the compressed cache) or "reprefill" (rebuild the
      media cache for each new question; only matters for query-aware methods).
    method_options: extra keyword arguments for the method's constructor.
    decode: how answer tokens run through the model (see visualkv.runtime.static_decode): "auto" (a CUDA graph per
      answer where it applies, else "eager"), "graph", "static" (fixed shapes without a graph) or "eager".
    decode_attention: attention of a fixed-shape decode step ("graph", "static"; see visualkv.runtime.static_decode):
      "auto" ("grouped" on CUDA over long windows, else "model"), "model" (the model's own SDPA or eager function
      with the window's mask) or "grouped" (batched matmuls over the masked window): the same answers up to rounding.
    vision_ahead: blocks whose media go through the vision tower in one call (1: a call per block). The
      embeddings are the same (each block's strip or frames a separate sequence in that call); more blocks
      per call mean fewer tower launches and a larger transient (counted by the memory guard). Every family.
    decode_read_every: sampled tokens per host read while decoding (visualkv.runtime.decode_loop); the text, EOS
      and Stop are seen at each read, and the answer and cache are the same whatever it is. None = 8 on an
      accelerator, 1 on the CPU (a read is free there, and the text streams per token).
    evidence: after each turn, compute its evidence recall (visualkv.runtime.evidence): a second, uncompressed
      pass over the conversation that reads where the answer looked and how much of it the cache kept.
    park_cache: where the session's state waits between turns (visualkv.runtime.park): "always" on the host (pinned
      where CUDA is available; a turn moves it to the device and back), "never" (it stays where the turn left it)
      or "auto" (on the host on ZeroGPU and in shared mode, else where it is).
    """

    method: str = "full"
    budget: int | None = None
    keep: float | None = None
    block_size: int | None = None
    prefill: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    followup: str = "reuse"
    method_options: dict[str, Any] = field(default_factory=dict)
    decode: str = "auto"
    decode_attention: str = "auto"
    vision_ahead: int = 1
    decode_read_every: int | None = None
    evidence: bool = False
    park_cache: str = "auto"

    @property
    def cache_headroom(self) -> int:
        """Entries a turn's cache allocates beyond its prefill: the answer's tokens and the last one fed back
        (so decoding never grows a buffer; the memory guard counts them too)."""
        return self.max_new_tokens + 1

    def resolved(self, visual_tokens: int) -> SessionConfig:
        """This config with its `keep` share turned into `budget` for media of `visual_tokens` (itself without one)."""
        if self.keep is None:
            return self
        return replace(self, budget=keep_budget(self.keep, visual_tokens))

    def validate(self) -> None:
        traits = method_traits(self.method)  # ConfigError for an unknown name or a refused composition
        if self.budget is not None:
            check_range("budget", self.budget, 1, MAX_BUDGET, whole=True)
        if self.keep is not None and not (isinstance(self.keep, (int, float)) and 0 < self.keep <= 1):
            raise ConfigError(
                f"keep must be a share of the visual tokens in (0, 1] (0.1 keeps 10 %), got {self.keep!r}"
            )
        if traits.needs_budget and self.budget is None and self.keep is None:
            raise ConfigError(
                f"method {self.method!r} needs a budget (visual entries kept per layer and KV head; --budget N, "
                "or --keep F for a share of the visual tokens)"
            )
        if self.block_size is not None:
            check_range("block size", self.block_size, 1, MAX_TOKENS, whole=True)
        if self.prefill not in (None, "hybrid", "blockwise", "bulk"):
            raise ConfigError(f"prefill must be hybrid, blockwise or bulk, got {self.prefill!r}")
        check_range("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS, whole=True)
        check_range("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_range("seed", self.seed, 0, MAX_SEED, whole=True)
        if self.followup not in ("reuse", "reprefill"):
            raise ConfigError("followup must be 'reuse' or 'reprefill'")
        check_range("vision_ahead (blocks per vision-tower call)", self.vision_ahead, 1, MAX_VISION_AHEAD, whole=True)
        if self.decode_read_every is not None:
            check_range(
                "decode_read_every (tokens per host read)", self.decode_read_every, 1, MAX_NEW_TOKENS, whole=True
            )
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"decode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ConfigError(
                f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, got {self.decode_attention!r}"
            )
        if self.park_cache not in PARK_MODES:
            raise ConfigError(f"park_cache must be one of {', '.join(PARK_MODES)}, got {self.park_cache!r}")


#: bounds of the settings (`SessionConfig.validate`): a block of more tokens than an hour of video holds, an
#: answer longer than any a chat needs, or more blocks per vision-tower call than make one call. A budget only
#: caps what is kept (one larger than the input keeps everything: the benches' "nothing evicted"), so its bound
#: is the largest token index a tensor holds
MAX_TOKENS = 1 << 20
MAX_BUDGET = 2**31 - 1
MAX_NEW_TOKENS = 32_768
MAX_TEMPERATURE = 10.0
MAX_SEED = 2**32 - 1
MAX_VISION_AHEAD = 64


def keep_budget(keep: float, visual_tokens: int) -> int:
    """The budget that keeps the share `keep` of `visual_tokens` (at least one entry)."""
    return max(1, round(keep * visual_tokens))


#: what a turn's media may be given as (see ChatSession.stream)
MediaSource = Media | str | os.PathLike | Image.Image | np.ndarray

#: most (layer, visual token) keep fractions written to the JSON report (~14 MB of JSON); beyond it only the
#: per-token average over layers (`retained`) is written
REPORT_PER_LAYER_VALUES = 2_000_000


@dataclass
class ChatState:
    """What a follow-up turn needs of a chat: everything a turn reads or changes, in one object its `ChatSession`
    owns. Parking (`visualkv.runtime.park`) moves this object to the host and back, and hands it to another process
    (a ZeroGPU call) and back; nothing else of a session crosses."""

    method: Method  # built for this chat; holds the state of the prefill that built the cache
    park_stats: ParkStats  # where the state waits between turns
    cache: CompressibleCache | None = None
    media: Media | None = None
    prepared: PreparedInput | None = None
    prefill_result: PrefillResult | None = None
    memory_estimate: MemoryEstimate | None = None  # the guard's estimate for the prefill that built the cache
    turns: list[TurnRecord] = field(default_factory=list)
    blocks: list[BlockEvent] = field(default_factory=list)
    next_position: int = 0  # position of the next token
    seq_len: int = 0  # tokens of the conversation so far (global index of the next token)
    history_ids: list[torch.Tensor] = field(default_factory=list)  # text fed after the media prefill, in order
    pending: int | None = None  # last sampled token, not yet run through the model
    rebuild_cache: bool = False  # the cache was freed after an out-of-memory: rebuild it on the next turn
    graph_failure: str | None = None  # why a CUDA graph capture failed once (then "auto" stays eager)
    answer_start: tuple[int, int, int] = (0, 0, 0)  # (history entries, global index, position) of the last answer
    evidence: Evidence | None = None  # the last turn's evidence, when computed


class _InState:
    """A `ChatSession` attribute that lives in the session's `ChatState` (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, session: ChatSession | None, owner: type | None = None) -> Any:
        return self if session is None else getattr(session.state, self.name)

    def __set__(self, session: ChatSession, value: Any) -> None:
        setattr(session.state, self.name, value)


class ChatSession:
    """One conversation: its state (`ChatState`), the model and the engine that run it, and its telemetry."""

    def __init__(
        self, adapter: ModelAdapter, config: SessionConfig | None = None, guard: MemoryGuard | None = None
    ) -> None:
        self.adapter = adapter
        self.config = config or SessionConfig()
        self.config.validate()
        if self.config.decode == "graph" and (why := graph_unsupported(adapter)):
            raise ConfigError(f"decode 'graph' is not possible here: {why}; use 'static', 'eager' or 'auto'")
        self.guard = guard or MemoryGuard()  # refuses a prefill that would not fit in memory
        self.engine = Engine(adapter)
        self.state: ChatState | None = None
        self.reset()

    # what a follow-up needs lives in `state` (see ChatState); these read and write it there
    cache = _InState()
    media = _InState()
    prepared = _InState()
    prefill_result = _InState()
    memory_estimate = _InState()
    turns = _InState()
    blocks = _InState()
    method = _InState()
    evidence = _InState()
    answer_start = _InState()
    park_stats = _InState()

    def reset(self) -> None:
        """Forget the media, the cache and the history (the model stays loaded, and so does a failed CUDA graph
        capture: "auto" decoding stays eager)."""
        self.state = ChatState(
            method=make_method(self.config.method, **self.config.method_options),
            park_stats=ParkStats(mode=self.config.park_cache),
            graph_failure=self.state.graph_failure if self.state is not None else None,
        )

    # -- public API ---------------------------------------------------------------
    def ask(self, prompt: str, media: MediaSource | None = None, **kwargs) -> TurnRecord:
        """Run one turn to completion and return its record."""
        for _ in self.stream(prompt, media, **kwargs):
            pass
        return self.turns[-1]

    def stream(
        self,
        prompt: str,
        media: MediaSource | None = None,
        on_block: Callable[[BlockEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[str]:
        """Yield answer text pieces as they are decoded.

        The first turn may carry media: a `Media` from `load_media`, or a file path, a PIL image or an RGB array,
        loaded here with the method's limits (default frame sampling; use `load_media` to choose it). Later
        turns reuse it. If anything fails before decoding starts, the session is left exactly as it was. `stop`
        is checked throughout the prefill, at least before every decoder layer and every few frames of a pass
        over the media (`Engine.prefill`; raising `PrefillStopped`, session unchanged), and at each read of the
        decoded tokens, every `decode_read_every` tokens (the answer so far is kept).
        """
        if not prompt or not prompt.strip():
            raise ConfigError("the question is empty; type a question about the image or video")
        if media is not None and self.turns:
            raise ConfigError("this chat already has media; start a new chat to use another file")
        media = self._as_media(media)
        unpark(self)  # a parked state comes back to the model's device for this turn
        try:
            yield from self._turn(prompt, media, on_block, stop)
        finally:
            if resolve_park(self.config.park_cache):
                park(self)  # between turns the state waits on the host (also after a failed or stopped turn)

    def _turn(self, prompt: str, media: Media | None, on_block, stop) -> Iterator[str]:
        """One turn on the device: prefill (first turn or follow-up), then decode (see `stream`)."""
        record = TurnRecord(prompt=prompt)
        reset_cuda_peak()  # cuda_peak_bytes is per turn: the same meaning in the CLI, the app and the benches
        t0 = time.perf_counter()
        should_stop = stop.is_set if stop is not None else None
        blocks_before = list(self.blocks)
        try:
            with block_attention.recording() as kernels:
                if not self.turns:
                    logits = self._first_turn(prompt, media, on_block, should_stop)
                else:
                    logits = self._followup_turn(prompt, on_block, should_stop)
        except Exception:
            self.blocks = blocks_before  # a failed or stopped prefill leaves no block behind
            raise
        record.prefill_attention = ",".join(sorted(kernels))
        record.prefill_seconds = time.perf_counter() - t0
        self.turns.append(record)
        self.evidence = None
        self.answer_start = (len(self.state.history_ids), self.state.seq_len, self.state.next_position)
        yield from self._decode(logits, record, t0, stop)
        record.cuda_peak_bytes = cuda_peak()
        if self.config.evidence and record.stopped != "stopped":
            try:
                self._compute_evidence(stop=stop)
            except VisualKVError as exc:  # refused or stopped: the answer stands, the turn says why it has no recall
                record.evidence_note = f"evidence not computed: {exc}"

    def compute_evidence(
        self, on_block: Callable[[BlockEvent], None] | None = None, stop: threading.Event | None = None
    ) -> Evidence | None:
        """The last turn's evidence recall and map (visualkv.runtime.evidence; a second, uncompressed pass, checked
        by the memory guard); None for a chat without visual tokens. Kept as `self.evidence` and in the report."""
        if not self.turns:
            raise ConfigError("evidence needs a finished turn: ask a question first")
        unpark(self)  # the pass reads the kept cache where the turns ran
        try:
            return self._compute_evidence(on_block, stop)
        finally:
            if resolve_park(self.config.park_cache):
                park(self)

    def _compute_evidence(self, on_block=None, stop: threading.Event | None = None) -> Evidence | None:
        should_stop = stop.is_set if stop is not None else None
        self.evidence = compute_evidence(self, on_block, should_stop)
        self.turns[-1].evidence_recall = self.evidence.recall if self.evidence is not None else None
        return self.evidence

    @property
    def sequence_length(self) -> int:
        """Tokens of the conversation so far."""
        return self.state.seq_len

    @property
    def history_ids(self) -> list[torch.Tensor]:
        """The text run after the media input, in order (questions, answers' tokens)."""
        return self.state.history_ids

    def _as_media(self, media: MediaSource | None) -> Media | None:
        """`media` as a validated Media: a path or an image is loaded under the method's limits."""
        if media is None or isinstance(media, Media):
            return media
        limits = media_limits(self.config.method)
        if isinstance(media, (str, os.PathLike)):
            return load_media(media, limits=limits)
        if isinstance(media, (Image.Image, np.ndarray)):
            return load_image(media, limits=limits)
        raise ConfigError(
            f"media must be a file path, a PIL image, an RGB array or a visualkv.Media (from load_media), "
            f"not {type(media).__name__}"
        )

    # -- turns --------------------------------------------------------------------
    def _first_turn(self, prompt: str, media: Media | None, on_block, should_stop=None) -> torch.Tensor:
        if media is not None and media.kind == "video":  # the frame cap follows the method (none if bounded)
            span = media.times[-1] - media.times[0] if media.num_frames > 1 else 0.0
            fps = (media.num_frames - 1) / span if span > 0 else 1.0
            media_limits(self.config.method).check_frame_count(media.num_frames, media.path or "the video", fps)
        with stop_scope(should_stop):  # a long video's preparation asks Stop as it goes
            prepared = self.adapter.prepare(media, prompt)
        self.config = self.config.resolved(prepared.layout.n_visual)  # a `keep` share becomes this media's budget
        estimate = self._estimate(prepared, should_stop)
        cache = self._new_cache()
        try:
            result = self.engine.prefill(
                prepared,
                cache,
                self.method,
                self.config.budget,
                self.config.block_size,
                self.config.prefill,
                on_block=self._collect(on_block),
                should_stop=should_stop,
                vision_ahead=self.config.vision_ahead,
            )
        except Exception:
            self.method = self._fresh_method()  # no state of the failed prefill stays behind
            raise
        self.cache, self.media, self.prepared, self.prefill_result = cache, media, prepared, result
        self.memory_estimate = estimate
        self.state.seq_len = prepared.seq_len
        self.state.next_position = prepared.next_position
        return result.logits

    def _estimate(self, prepared: PreparedInput, should_stop) -> MemoryEstimate:
        """The memory guard's check of this prefill; Stop (and the time limit) asked before it and at every
        block its estimate plans, so a stop pressed while a long input is sized ends the turn there."""
        with stop_scope(should_stop):
            stop_point()
            return self.guard.check(self.adapter, prepared, self.config)

    def _new_cache(self) -> CompressibleCache:
        """An empty cache for this model, with room for the answer (decoding never grows a buffer)."""
        return CompressibleCache(
            self.adapter.num_layers, headroom=self.config.cache_headroom, query_group=self.adapter.query_group
        )

    def _fresh_method(self):
        return make_method(self.config.method, **self.config.method_options)

    def _followup_turn(self, prompt: str, on_block, should_stop=None) -> torch.Tensor:
        ids = self.adapter.followup_ids(prompt)
        if self.state.pending is not None:
            ids = torch.cat([torch.tensor([self.state.pending]), ids])
        reprefill = self.config.followup == "reprefill" and self.method.query_aware
        if (reprefill or self.state.rebuild_cache) and self.prepared is not None:
            return self._reprefill(prompt, ids, on_block, should_stop)
        held = self.cache.entries_per_layer()
        try:  # Stop and the time limit hold inside the question's pass, however long the question
            logits = self.engine.extend(
                ids, self.state.next_position, self.state.seq_len, self.cache, should_stop=should_stop
            )
        except PrefillStopped:
            self.cache.truncate(held)  # the entries the question appended go: the cache is as before the turn
            raise
        self._advance(ids)
        return logits

    def _reprefill(self, prompt: str, ids: torch.Tensor, on_block, should_stop=None) -> torch.Tensor:
        """Rebuild the media cache with `prompt` as the proxy question, replay the history."""
        estimate = self._estimate(self.prepared, should_stop)
        cache = self._new_cache()
        method = self._fresh_method()  # swapped in only when the whole rebuild succeeded
        method.proxy_ids = torch.tensor(self.adapter.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        self.blocks = []
        result = self.engine.prefill(
            self.prepared,
            cache,
            method,
            self.config.budget,
            self.config.block_size,
            self.config.prefill,
            on_block=self._collect(on_block),
            should_stop=should_stop,
            vision_ahead=self.config.vision_ahead,
        )
        method.proxy_ids = None
        history = torch.cat(self.state.history_ids + [ids]) if self.state.history_ids else ids
        # the whole conversation again, into the new cache (dropped when stopped): Stop and the time limit hold
        logits = self.engine.extend(
            history, self.prepared.next_position, self.prepared.seq_len, cache, should_stop=should_stop
        )
        self.cache, self.prefill_result, self.method = cache, result, method
        self.memory_estimate = estimate
        self.state.rebuild_cache = False
        self._advance(ids)
        return logits

    def _advance(self, ids: torch.Tensor) -> None:
        self.state.history_ids.append(ids)
        self.state.seq_len += int(ids.shape[0])
        self.state.next_position += int(ids.shape[0])
        self.state.pending = None

    def _collect(self, on_block):
        def callback(event: BlockEvent) -> None:
            self.blocks.append(event)
            if on_block is not None:
                on_block(event)

        return callback

    # -- out-of-memory recovery (visualkv.runtime.memory_guard.out_of_memory_caught) -----------------------
    def snapshot(self) -> dict[str, Any]:
        """What a turn may change, taken before it starts (the state unparked first, so a rollback puts back
        tensors where the turn runs them)."""
        unpark(self)
        return {
            "turns": len(self.turns),
            "blocks": list(self.blocks),
            "history": len(self.state.history_ids),
            "seq_len": self.state.seq_len,
            "next_position": self.state.next_position,
            "pending": self.state.pending,
            "cache": self.cache,
            "media": self.media,
            "prepared": self.prepared,
            "prefill_result": self.prefill_result,
            "memory_estimate": self.memory_estimate,
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Undo a failed turn. A cache the turn may have extended is freed; the next turn rebuilds it from
        the media and the conversation so far (a first turn simply leaves the session empty). The snapshot's
        objects are those the turn ran on: a state the failed turn parked comes back first, and parks again after."""
        unpark(self)
        del self.turns[snapshot["turns"] :]
        del self.state.history_ids[snapshot["history"] :]
        self.blocks = snapshot["blocks"]
        self.state.seq_len, self.state.next_position = snapshot["seq_len"], snapshot["next_position"]
        self.state.pending = snapshot["pending"]
        self.media, self.prepared, self.prefill_result = snapshot["media"], snapshot["prepared"], None
        self.cache = None
        self.state.rebuild_cache = snapshot["cache"] is not None
        self.memory_estimate = None
        self.evidence = None
        if self.state.rebuild_cache:
            self.prefill_result = snapshot["prefill_result"]
            self.memory_estimate = snapshot["memory_estimate"]
        if resolve_park(self.config.park_cache):
            park(self)

    # -- decoding -----------------------------------------------------------------
    def _decode(self, logits: torch.Tensor, record: TurnRecord, t0: float, stop) -> Iterator[str]:
        generator = torch.Generator(device=logits.device).manual_seed(self.config.seed + len(self.turns))
        record.stopped = "max_new_tokens"
        self.cache.reserve(self.config.cache_headroom)  # one growth now, none while decoding
        steps = self.config.max_new_tokens
        limits = DecodeLimits(
            self.adapter.eos_token_ids,
            steps,
            read_interval(self.config.decode_read_every, logits.device),
            stop.is_set if stop is not None else None,
        )
        feeder = Feeder(self.engine, self.cache, self.state.next_position, self.state.seq_len)
        detok = IncrementalDetokenizer(self.adapter.tokenizer)
        loop = DecodeLoop(feeder, lambda lg: self._sample(lg, generator), limits, record, detok)
        try:
            yield from loop.run(logits, t0, lambda: self._static_decoder(record, steps - 1))
        finally:  # also when the caller stops iterating: the tokens fed so far are part of the conversation
            self.state.history_ids.extend(torch.tensor([token]) for token in loop.fed_ids)
            self.state.seq_len += len(loop.fed_ids)
            self.state.next_position += len(loop.fed_ids)
            self.state.pending = loop.pending
        # a token cut inside a UTF-8 sequence decodes to U+FFFD: never end an answer on one
        record.answer = self.adapter.tokenizer.decode(record.token_ids, skip_special_tokens=True).rstrip("\ufffd")
        n = len(record.token_ids)
        if loop.t_first is not None and n > 1:
            record.decode_tokens_per_second = (n - 1) / max(time.perf_counter() - loop.t_first, 1e-9)
        record.kv_bytes_after = self.cache.kv_bytes()

    def _static_decoder(self, record: TurnRecord, steps: int) -> StaticDecoder | None:
        """The fixed-shape decoder for this answer, or None for plain steps; sets `record.decode_mode`."""
        mode = self.config.decode
        if mode == "auto":
            mode = "eager" if self.state.graph_failure or graph_unsupported(self.adapter) else "graph"
        record.decode_mode = mode
        if mode == "eager":
            if self.state.graph_failure:
                record.decode_mode = f"eager (graph capture failed: {self.state.graph_failure})"
            return None
        args = (self.adapter, self.cache, steps, self.state.next_position, self.state.seq_len, mode == "graph")
        attention = self.config.decode_attention
        if mode == "static":
            decoder = StaticDecoder(*args, attention=attention)
            record.decode_attention = decoder.attention
            return decoder
        try:
            decoder = StaticDecoder(*args, attention=attention)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured: decode this turn eagerly
            self.state.graph_failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            warnings.warn(
                f"CUDA graph decoding unavailable, decoding eagerly: {self.state.graph_failure}", stacklevel=2
            )
            record.decode_mode = f"eager (graph capture failed: {self.state.graph_failure})"
            return None
        record.decode_attention = decoder.attention
        return decoder

    def _sample(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Greedy or top-p sampling of one token, returned as a 0-d tensor on the logits' device (read back by
        the decode loop every few tokens); `generator` lives on the logits' device.

        Sampling stays on the device, so the same seed gives the same
        tokens run to run on one device; CPU and CUDA generators differ, so a seed does not give the same
        tokens across devices.
        """
        if self.config.temperature <= 0:
            return logits.argmax()
        probs = torch.softmax(logits.float() / self.config.temperature, dim=-1)
        if self.config.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            cut = sorted_p.cumsum(0) - sorted_p > self.config.top_p
            sorted_p = sorted_p.masked_fill(cut, 0)  # not `sorted_p[cut] = 0`: a boolean index reads the device
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return torch.multinomial(probs / probs.sum(), 1, generator=generator)[0]

    # -- report -------------------------------------------------------------------
    def full_kv_bytes(self) -> int:
        """Bytes an uncompressed cache would hold for this conversation so far."""
        a = self.adapter
        itemsize = torch.empty((), dtype=a.dtype).element_size()
        tokens = self.state.seq_len
        return tokens * a.num_layers * 2 * a.num_kv_heads * a.head_dim * itemsize

    def retained_per_layer(self) -> np.ndarray:
        """(layers, n_visual) keep fraction of every visual token over the KV heads of each layer."""
        if self.prepared is None or self.cache is None:
            return np.zeros((0, 0))
        n_visual = self.prepared.layout.n_visual
        lookup = torch.from_numpy(self.prepared.layout.visual_id_of_seq(self.prepared.seq_len))
        rows = []
        for layer in self.cache.layers:
            counts = torch.zeros(n_visual, dtype=torch.float64)
            if layer.is_initialized:
                idx = layer.all_token_index()[0].long().flatten().cpu()  # heads x entries
                vid = lookup[idx[idx < self.prepared.seq_len]]
                counts += torch.bincount(vid[vid >= 0], minlength=n_visual).double()
                counts /= layer.token_index.shape[1]
            rows.append(counts)
        return torch.stack(rows).numpy()

    def retained(self) -> np.ndarray:
        """Keep fraction of every visual token over (layer, KV head)."""
        per_layer = self.retained_per_layer()
        return per_layer.mean(axis=0) if per_layer.size else np.zeros(0)

    def report(self) -> dict[str, Any]:
        """The JSON report (docs/CLI.md lists every field)."""
        layout = self.prepared.layout if self.prepared is not None else None
        ctx = self.prefill_result.context if self.prefill_result is not None else None
        report: dict[str, Any] = {
            "model": self.adapter.name,
            # the model's own kernel, also while another chat's turn has the model inside `patched`
            "model_info": model_info(self.adapter),
            "method": self.config.method,
            "method_config": self.method.config_dict(),
            "budget": self.config.budget,
            "keep": self.config.keep,
            "block_size": ctx.block_size if ctx else self.config.block_size,
            "prefill": ctx.prefill_mode if ctx else self.config.prefill,
            "config": asdict(self.config),
            "media": _media_summary(self.media),
            "visual_tokens": layout.n_visual if layout else 0,
            "prompt_tokens": self.prepared.seq_len if self.prepared is not None else 0,
            "peak_kv_bytes": self.cache.peak_kv_bytes if self.cache else 0,
            "final_kv_bytes": self.cache.kv_bytes() if self.cache else 0,
            "index_bytes": self.cache.index_bytes() if self.cache else 0,
            # device view: buffers allocated (free capacity included) and their peak with transients (one layer's
            # dequantized packed tiers among them: no dequantized copy is kept, see visualkv.attention.packed)
            "allocated_kv_bytes": self.cache.allocated_bytes() if self.cache else 0,
            "peak_device_kv_bytes": self.cache.peak_device_bytes if self.cache else 0,
            # what the memory guard estimated before the prefill that built this cache (docs/APP.md: the memory guard)
            "memory_estimate": self.memory_estimate.summary() if self.memory_estimate else None,
            # between turns: where the state waits (visualkv.runtime.park), its bytes and the time to move them
            "park": self.park_stats.to_dict(),
            "full_kv_bytes": self.full_kv_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            # the last turn's CUDA peak (reset when each turn starts), counted over the whole process: CUDA keeps
            # one count per device, so turns of other sessions running meanwhile are in it (`CUDA_PEAK_SCOPE`)
            "cuda_peak_bytes": next(
                (t.cuda_peak_bytes for t in self.turns[-1:] if t.cuda_peak_bytes is not None), cuda_peak()
            ),
            "cuda_peak_scope": CUDA_PEAK_SCOPE,
            "blocks": [b.to_dict() for b in self.blocks],
            "turns": [t.to_dict() for t in self.turns],
            "retained": self.retained().round(4).tolist(),
        }
        has_prefill = self.cache is not None and self.prepared is not None
        n_values = len(self.cache.layers) * self.prepared.layout.n_visual if has_prefill else 0
        if n_values <= REPORT_PER_LAYER_VALUES:
            report["retained_per_layer"] = self.retained_per_layer().round(3).tolist()
        else:  # an hour of video: 28 layers x 540k tokens would be ~100 MB of JSON and ~0.7 GB of Python floats
            report["retained_per_layer_omitted"] = (
                f"{n_values:,} values (layers x visual tokens) exceed the report's {REPORT_PER_LAYER_VALUES:,}; "
                "see `retained` (averaged over layers) or ChatSession.retained_per_layer()"
            )
        if layout is not None:
            report["layout"] = {
                "frames": [
                    {
                        "kind": f.kind,
                        "grid": list(f.grid),
                        "time": f.time,
                        "box": list(f.box),
                        "source_frames": list(f.source_frames),
                    }
                    for f in layout.frames
                ],
                "token_frame": layout.frame.tolist(),
                "token_row": layout.row.tolist(),
                "token_col": layout.col.tolist(),
                "media_size": list(layout.media_size),
            }
        if self.media is not None and self.media.kind == "video":
            report["frames"] = [
                {"index": i, "time": float(t), "skipped": False} for i, t in enumerate(self.media.times)
            ]
            report["vision_encoder_frames"] = len(set(ctx.encoded_frames)) if ctx is not None else 0
        if ctx is not None:
            report.update(self.method.report(ctx))
        report["evidence_recall"] = self.evidence.recall if self.evidence is not None else None
        if self.evidence is not None:
            report["evidence"] = self.evidence.report(REPORT_PER_LAYER_VALUES)
        return report


def _media_summary(media: Media | None) -> dict[str, Any] | None:
    if media is None:
        return None
    width, height = media.size
    # the file name only: a path would tell a shared instance's users about the server's folders
    name = os.path.basename(media.path) if media.path else None
    return {
        "kind": media.kind,
        "name": name,
        "width": width,
        "height": height,
        "frames": len(media.frames),
        "duration": media.duration,
        # what the user should know about the file (first frame only read, frames undecodable and stood in
        # for, values stretched), with the file's folder left out as above
        "warnings": [w.replace(media.path, name) if media.path else w for w in media.warnings],
    }
