"""Lazily decoded video frames (:class:`LazyFrames`): memory that does not grow with the video.

An hour at 1 fps is 3,600 sampled frames, of which a block-wise prefill holds a few at a time, so only
the last few decoded frames are kept; a frame that cannot be decoded when its turn comes is replaced by
the nearest earlier one, with a warning, so a long prefill is never lost at frame 3,000. A pickled
:class:`LazyFrames` is a reader, not frames: the copy reopens the file on first use (a call in another process
gets the video in a few kilobytes).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from visualkv.errors import MediaError
from visualkv.media.flat import FlatWatch
from visualkv.media.messages import no_decodable_frame
from visualkv.media.resize import resize_to, resize_to_width

if TYPE_CHECKING:
    from visualkv.media.readers import FrameDecoder


class _LiveCount:
    """How many decoded frames are alive (referenced anywhere), and the most ever at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def born(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def died(self) -> None:
        self.now -= 1


class LazyFrames(Sequence[np.ndarray]):
    """A video's sampled frames, decoded when indexed: a read-only ``Sequence[np.ndarray]``.

    ``frames[k]`` decodes sampled frame k (RGB uint8, HxWx3) unless it is among the last
    ``cache_size`` decoded (so a Qwen temporal patch or a block's frames are not decoded twice);
    ``frames[a:b]`` gives a list. Decoding is serialised by a lock (the app may draw thumbnails
    while a prefill runs). A frame that cannot be decoded is replaced, consistently, by the nearest
    earlier decodable one (frames before the first decodable one: by that one), and a warning is
    appended to the Media's ``warnings``. ``frame_shape`` comes from the first decodable frame,
    decoded when the video is loaded. Statistics for tests and benchmarks: ``decoded`` (decode
    calls), ``live_frames`` / ``peak_live_frames`` (decoded arrays alive anywhere, now / at most).
    """

    def __init__(
        self,
        decoder: FrameDecoder,
        indices: Sequence[int],
        fps: float,
        notes: list[str],
        name: str,
        cache_size: int = 4,
    ) -> None:
        if cache_size < 1:
            raise MediaError(f"LazyFrames.cache_size must be >= 1, got {cache_size}")
        self._decoder = decoder
        self._indices = list(indices)
        self._fps = fps
        self._notes = notes
        self.cache_size = cache_size
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._stand_ins: dict[int, int] = {}  # undecodable position -> position shown instead
        self._lock = threading.RLock()
        self._live = _LiveCount()
        self.decoded = 0
        self._source_shape: tuple[int, ...] | None = None  # decoded size (first decodable frame)
        self._shape: tuple[int, ...] | None = None  # size of the frames given out (== source unless resized)
        self._resize: Callable[[np.ndarray], np.ndarray] | None = None
        self._base: LazyFrames | None = None  # the sequence a resized view shares its decoder with
        self._flat = FlatWatch(name, len(self._indices), notes)  # shared with resized views
        weakref.finalize(self, decoder.close)
        first = next((k for k in range(len(self._indices)) if self._fetch(k, remember=True) is not None), None)
        if first is None:
            raise no_decodable_frame(name, len(self._indices))
        for k in range(first):
            self._stand_in(k, first)

    # -- Sequence ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, key):  # int -> array, slice -> list of arrays
        if isinstance(key, slice):
            return [self._get(k) for k in range(*key.indices(len(self)))]
        k = int(key)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"frame {key} out of range ({len(self)} frames)")
        return self._get(k)

    def __repr__(self) -> str:
        h, w = self.frame_shape[:2]
        return f"LazyFrames({len(self)} x {w}x{h}, cached={len(self._cache)})"

    # -- pickling: another process reopens the file --------------------------------------------
    def __getstate__(self) -> dict:
        """What another process needs to decode the same frames: the decoder's file and backends (no open
        reader), the sampled indices, fps, sizes, resize, cache size, undecodable-frame stand-ins and warnings;
        no lock, cached frame or statistics."""
        state = dict(vars(self))  # the stand-ins and warnings stay the objects a view shares with its base
        for name in ("_cache", "_lock", "_live", "decoded"):
            del state[name]
        return state

    def __copy__(self) -> LazyFrames:
        """The same reader (a second one on the same decoder would need its lock and would close it twice)."""
        return self

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._cache, self._live, self.decoded = OrderedDict(), _LiveCount(), 0
        # a view's base is unpickled first (it is part of the view's state): they share its lock again
        self._lock = self._base._lock if self._base is not None else threading.RLock()
        if self._base is None:
            weakref.finalize(self, self._decoder.close)

    @property
    def file(self) -> Path:
        """The video file the frames are decoded from."""
        return self._decoder.file

    # -- metadata and statistics -------------------------------------------------------------
    @property
    def frame_shape(self) -> tuple[int, ...]:
        """(height, width, 3) of the frames this sequence gives (a resized view: the resized size)."""
        assert self._shape is not None
        return self._shape

    @property
    def source_shape(self) -> tuple[int, ...]:
        """(height, width, 3) of the frames as decoded."""
        assert self._source_shape is not None
        return self._source_shape

    @property
    def is_resized(self) -> bool:
        return self._resize is not None

    def resized(self, size: tuple[int, int], resize: Callable[[np.ndarray], np.ndarray]) -> LazyFrames:
        """A view of the same frames at ``size`` (height, width): each frame goes through ``resize`` (an
        (H, W, 3) uint8 frame -> (height, width, 3) uint8) right after it is decoded, before it is cached, so
        this view holds small frames only (one full-size frame is alive while it is being resized). It
        shares this sequence's decoder, lock, undecodable-frame stand-ins and warnings, and has its own
        cache and statistics. Nothing is decoded here. The view pickles with ``resize``: make it a
        module-level function or a ``functools.partial`` of one (not a lambda or a closure)."""
        # a shallow copy shares the decoder, indices, lock, warnings and the undecodable-frame stand-ins (an
        # undecodable frame is looked for, and reported, once); what is the view's own is set anew below
        view = object.__new__(type(self))
        vars(view).update(vars(self))
        view._cache = OrderedDict()
        view._live = _LiveCount()
        view.decoded = 0
        view._shape = (int(size[0]), int(size[1]), *self.source_shape[2:])
        view._resize = resize
        view._base = self._base or self  # keeps the decoder open (it is closed when the base is collected)
        return view

    @property
    def cached_bytes(self) -> int:
        return sum(int(f.nbytes) for f in self._cache.values())

    @property
    def live_frames(self) -> int:
        return self._live.now

    @property
    def peak_live_frames(self) -> int:
        return self._live.peak

    @property
    def backends_used(self) -> set[str]:
        return set(self._decoder.used)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def iter_small(self, width: int) -> Iterator[np.ndarray]:
        """Every frame in order, resized to ``width`` (see :func:`resize_to_width`) right after
        decoding; bypasses the cache, so one full-size frame is alive at a time."""
        for k in range(len(self)):
            with self._lock:
                frame = self._get(k, remember=False)
            small = resize_to_width(frame, width)
            del frame
            yield small

    # -- decoding ----------------------------------------------------------------------------
    def _get(self, k: int, remember: bool = True) -> np.ndarray:
        with self._lock:
            k = self._stand_ins.get(k, k)
            cached = self._cache.get(k)
            if cached is not None:
                self._cache.move_to_end(k)
                return cached
            frame = self._fetch(k, remember)
            if frame is not None:
                return frame
            # undecodable: the nearest earlier decodable frame stands in (position 0 always decodes
            # or has a stand-in from the constructor)
            for j in range(k - 1, -1, -1):
                j = self._stand_ins.get(j, j)
                frame = self._cache.get(j)
                if frame is None:
                    frame = self._fetch(j, remember)
                if frame is not None:
                    self._stand_in(k, j)
                    return frame
            raise AssertionError("unreachable: the first frame decodes or has a stand-in")

    def _fetch(self, k: int, remember: bool) -> np.ndarray | None:
        """Decode position k (no stand-in); None if undecodable."""
        frame = self._decoder.read(self._indices[k])
        self.decoded += 1
        if frame is None:
            if not self.file.exists():  # not an undecodable frame: the whole video is gone (an upload expired)
                raise MediaError(f"'{self.file.name}': the video's file is gone from the server; upload it again")
            return None
        frame = np.ascontiguousarray(frame, dtype=np.uint8)
        self._flat.saw(k, frame)
        if self._source_shape is None:
            self._source_shape = self._shape = tuple(frame.shape)
        elif tuple(frame.shape) != self._source_shape:  # a mid-stream size change: keep one frame size
            frame = np.ascontiguousarray(resize_to(frame, self._source_shape))
        if self._resize is not None:  # resized before it is cached: the full-size frame dies here
            frame = np.ascontiguousarray(self._resize(frame), dtype=np.uint8)
            if tuple(frame.shape) != self._shape:
                raise AssertionError(f"frame resized to {frame.shape}, expected {self._shape}")
        self._live.born()
        weakref.finalize(frame, self._live.died)
        if remember:
            self._cache[k] = frame
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return frame

    def _stand_in(self, k: int, j: int) -> None:
        self._stand_ins[k] = j
        index, other = self._indices[k], self._indices[j]
        self._notes.append(
            f"frame {index} (t={index / self._fps:.2f} s) could not be decoded; frame {other} "
            f"(t={other / self._fps:.2f} s) shown in its place"
        )
