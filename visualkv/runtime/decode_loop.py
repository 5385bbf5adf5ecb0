"""An answer's decode loop: sampled tokens stay on the device and are read back every few tokens.

Reading each sampled id back to the host (for EOS and the streamed text) stalls a GPU's launch queue once per
token. Here every sampled id is written into a device buffer and fed straight back to the model; the host reads the
buffer once per `read_every` tokens (`SessionConfig.decode_read_every`: by default 8 on an accelerator, 1 on the
CPU, where a read costs nothing and the text streams per token), and always at the first token (its time is the
TTFT, and the fixed-shape decoder is built after it) and at the last one the length cap allows.

At a read the tokens are handed over one by one, with the checks the per-token loop makes after each token: EOS,
and at the read's last token (the only one not fed yet) Stop, which a turn's time limit sets too, and the length
cap. Tokens fed after an EOS are taken back out of the cache (`StaticDecoder.rewind`, `CompressibleCache.truncate`),
so the answer, the cache after the turn and every later turn are exactly those of the per-token loop
(tests/test_decode_reads.py). So is the cache when the reader stops iterating mid-read: it holds the tokens fed up
to the piece last yielded, as the per-token loop's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import torch

from visualkv.kv.cache import CompressibleCache
from visualkv.report.telemetry import TurnRecord
from visualkv.runtime.detokenize import IncrementalDetokenizer
from visualkv.runtime.engine import Engine
from visualkv.runtime.static_decode import StaticDecoder

#: tokens per host read on an accelerator when `SessionConfig.decode_read_every` is None
ACCELERATOR_READ_EVERY = 8


def read_interval(setting: int | None, device: torch.device | str) -> int:
    """Tokens per host read: `setting`, or by default 1 on the CPU and `ACCELERATOR_READ_EVERY` elsewhere."""
    if setting is not None:
        return int(setting)
    return 1 if torch.device(device).type == "cpu" else ACCELERATOR_READ_EVERY


class Feeder:
    """Runs fed tokens through the model, and takes the newest back out of the cache.

    Through the fixed-shape decoder once one is set (`decoder`), else `Engine.extend`. position / seq_index: the
    position id and conversation index of the answer's first fed token (host ints).
    """

    def __init__(self, engine: Engine, cache: CompressibleCache, position: int, seq_index: int) -> None:
        self.engine, self.cache = engine, cache
        self.position, self.seq_index = position, seq_index
        self.decoder: StaticDecoder | None = None
        self.fed = 0  # tokens run through the model so far
        self._held = cache.entries_per_layer()  # entries per layer before the answer

    def feed(self, token: torch.Tensor) -> torch.Tensor:
        """Run `token` (a 0-d device tensor); returns the next logits."""
        if self.decoder is not None:
            logits = self.decoder.step(token)
        else:
            offset = self.fed
            logits = self.engine.extend(token.view(1), self.position + offset, self.seq_index + offset, self.cache)
        self.fed += 1
        return logits

    def rewind(self, n: int) -> None:
        """Take the last `n` fed tokens back out: the cache then holds what feeding only the others leaves."""
        if n <= 0:
            return
        if self.decoder is not None:
            self.decoder.rewind(n)
        else:
            self.cache.truncate([held + self.fed - n for held in self._held])
        self.fed -= n

    def finish(self) -> None:
        if self.decoder is not None:
            self.decoder.finish()


@dataclass
class DecodeLimits:
    """When an answer ends: an EOS id, `max_new_tokens` sampled, or `stop` set (seen at a read)."""

    eos: set[int]
    max_new_tokens: int
    read_every: int
    stop: Callable[[], bool] | None = None


class DecodeLoop:
    """Samples, feeds and hands over one answer's tokens (see the module docstring).

    After `run` (also when its reader stops early): `fed_ids`, the tokens the per-token loop would have run through
    the model (the cache holds exactly their entries), and `pending`, the last token sampled but not fed when the
    answer ended at Stop or the length cap (the next turn feeds it first), else None.
    """

    def __init__(
        self,
        feeder: Feeder,
        sample: Callable[[torch.Tensor], torch.Tensor | int],
        limits: DecodeLimits,
        record: TurnRecord,
        detok: IncrementalDetokenizer,
    ) -> None:
        self.feeder, self.sample, self.limits = feeder, sample, limits
        self.record, self.detok = record, detok
        self.fed_ids: list[int] = []
        self.pending: int | None = None
        self.t_first: float | None = None
        self.reads = 0  # host reads of sampled tokens
        self._t0 = 0.0

    def run(self, logits: torch.Tensor, t0: float, make_decoder: Callable[[], StaticDecoder | None]) -> Iterator[str]:
        """Yield the answer's text pieces; `t0`: when the turn began (for the TTFT); `make_decoder`: the fixed-shape
        decoder for the rest of the answer (or None), built after the first token."""
        limits, record = self.limits, self.record
        self._t0 = t0
        tokens = torch.empty(limits.max_new_tokens, dtype=torch.long, device=logits.device)
        read = 0  # tokens handed to the host so far
        try:
            for step in range(limits.max_new_tokens):
                token = torch.as_tensor(self.sample(logits), device=tokens.device).reshape(())
                tokens[step] = token  # a device write: nothing read yet
                last = step == limits.max_new_tokens - 1
                if step == 0 or last or step % limits.read_every == 0:
                    # the host read, once per `read_every` tokens: EOS, Stop and the text need the ids
                    ids = tokens[read : step + 1].tolist()
                    self.reads += 1
                    read = step + 1
                    if (yield from self._hand_over(ids, step, last)):
                        return
                if step == 0:  # built after the first token: its time counts in decoding, not in TTFT
                    t_setup = time.perf_counter()
                    self.feeder.decoder = make_decoder()
                    record.decode_setup_seconds = time.perf_counter() - t_setup
                logits = self.feeder.feed(token)
                if read == step + 1:  # read at this step: the token just fed is known on the host
                    self.fed_ids.append(ids[-1])
        finally:  # tokens fed after the end (an EOS, or the reader gone mid-read) leave the cache
            self.feeder.rewind(self.feeder.fed - len(self.fed_ids))
            self.feeder.finish()

    def _hand_over(self, ids: list[int], step: int, last: bool) -> Generator[str, None, bool]:
        """Hand a read's tokens (those sampled at steps step - len(ids) + 1 .. step) over one by one, as the
        per-token loop does; returns True when the answer ends among them."""
        record = self.record
        for index, token_id in enumerate(ids, start=step + 1 - len(ids)):
            if index == 0:
                self.t_first = time.perf_counter()
                record.ttft_seconds = self.t_first - self._t0
            if token_id in self.limits.eos:
                record.stopped = "eos"
                return True
            record.token_ids.append(token_id)
            piece = self.detok.push(token_id)
            if piece:
                record.answer = self.detok.text
                yield piece
            if index < step:  # fed already: kept
                self.fed_ids.append(token_id)
                continue
            if self.limits.stop is not None and self.limits.stop():
                record.stopped = "stopped"
            if last or record.stopped == "stopped":
                self.pending = token_id
                return True
        return False
