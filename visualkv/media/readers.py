"""Frame readers by source index: decord (batched, re-opened after an error) and OpenCV (sequential
forward reads, a seek for a jump), and the lazy decoder that tries OpenCV first."""

from __future__ import annotations

import math
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from visualkv.media.backends import import_cv2, import_decord
from visualkv.media.probe import VideoInfo


class DecordReader:
    """decord VideoReader, re-created after an error: after a failed frame its decoder state is
    unreliable (the next seek fails too). Gives up after a few failures, because each re-open
    re-reads the whole packet index."""

    _MAX_FAILURES = 3

    def __init__(self, file: Path) -> None:
        self._decord = import_decord()
        self._path = str(file)
        self._reader = self._open()
        self._failures = 0
        fps = float(self._reader.get_avg_fps())
        self.info = VideoInfo(frame_count=len(self._reader), fps=fps)

    def _open(self) -> Any:  # decord has no type stubs
        return self._decord.VideoReader(self._path, num_threads=0)

    def read_many(self, indices: list[int]) -> dict[int, np.ndarray]:
        """Decode frames in one batch; on failure frame by frame, leaving out failed ones."""
        try:
            batch = self._reader.get_batch(indices).asnumpy()  # (N, H, W, 3) RGB
        except Exception:  # noqa: BLE001 - decord raises DECORDError, RuntimeError, ...
            self._reader = None
        else:
            if batch.ndim == 4 and batch.shape[3] == 3:
                return {index: batch[k] for k, index in enumerate(indices)}
        decoded = {index: self.read_one(index) for index in indices}
        return {index: frame for index, frame in decoded.items() if frame is not None}

    def read_one(self, index: int) -> np.ndarray | None:
        if self._failures >= self._MAX_FAILURES:
            return None
        try:
            if self._reader is None:
                self._reader = self._open()
            frame = self._reader[index].asnumpy()
        except Exception:  # noqa: BLE001 - any decord failure means "not decodable here"
            frame = None
        if frame is None or frame.ndim != 3 or frame.shape[2] != 3:
            self._failures += 1
            self._reader = None
            return None
        return frame


class OpenCVReader:
    """cv2.VideoCapture reading frames by index; OpenCV applies rotation metadata itself.

    Short forward gaps are read sequentially (grab), longer ones seek. An FFmpeg seek can land
    a frame early after a corrupt frame, so each grabbed frame's timestamp decides which index
    it really is; a target frame that cannot be decoded gives None.
    """

    def __init__(self, file: Path, fps: float) -> None:
        self._cv2 = import_cv2()
        self._capture = self._cv2.VideoCapture(str(file))
        if not self._capture.isOpened():
            raise OSError("OpenCV cannot open the file")
        self._fps = fps
        self._max_gap = self.max_gap_for(fps)
        self._last = -1  # index of the last grabbed frame

    @staticmethod
    def max_gap_for(fps: float) -> int:
        """Grabbing up to ~4 s forward is cheaper than a seek (which decodes from a keyframe)."""
        return max(16, int(4 * fps))

    def read(self, index: int) -> np.ndarray | None:
        if not (self._last < index <= self._last + self._max_gap):
            self._capture.set(self._cv2.CAP_PROP_POS_FRAMES, index)
            self._last = index - 1
        # A few extra steps for seeks that land early.
        for _ in range(index - self._last + 8):
            if not self._capture.grab():
                self._last += 1  # a failed grab still consumes that frame's packet
                if self._last >= index:
                    return None
                continue
            seconds = self._capture.get(self._cv2.CAP_PROP_POS_MSEC) / 1000.0
            self._last = math.floor(seconds * self._fps + 0.5)
            if self._last == index:
                return self._retrieve()
            if self._last > index:
                return None  # the stream moved past the target: it was undecodable
        return None

    def _retrieve(self) -> np.ndarray | None:
        ok, bgr = self._capture.retrieve()
        if not ok or bgr is None:
            return None
        return self._cv2.cvtColor(bgr, self._cv2.COLOR_BGR2RGB)

    def close(self) -> None:
        self._capture.release()


def read_opencv(file: Path, fps: float, indices: list[int]) -> dict[int, np.ndarray]:
    try:
        reader = OpenCVReader(file, fps)
    except OSError:
        return {}
    try:
        frames = {index: reader.read(index) for index in indices}
    finally:
        reader.close()
    return {index: frame for index, frame in frames.items() if frame is not None}


class FrameDecoder:
    """Decodes one frame by source index: OpenCV first (sequential reads forward, a seek for a jump),
    decord where OpenCV is missing or fails on that frame. Why OpenCV first, although decord's random
    access is the faster seek: over a 30-minute video (1,800 frames) a composed prefill reading frames
    through decord grew the process by 0.1 to 1 GB from run to run (its decoder's buffers), through
    OpenCV by under 20 MB, so only OpenCV keeps an hour of video in bounded memory."""

    def __init__(self, file: Path, fps: float, decord_reader: DecordReader | None, use_cv2: bool) -> None:
        _DECODERS.add(self)  # first: a fork from now on finds the readers it holds
        self._file, self._fps = file, fps
        self._decord = decord_reader
        self._use_cv2 = use_cv2
        self._opencv: OpenCVReader | None = None
        self._reopen_decord = False  # a copy unpickled in another process: decord is opened on first need
        self.used: set[str] = set()  # backends that produced a frame

    def read(self, index: int) -> np.ndarray | None:
        frame = self._read_cv2(index)
        if frame is not None or self._decord_reader() is None:
            return frame
        frame = self._decord.read_one(index)
        if frame is not None:
            self.used.add("decord")
        return frame

    def _decord_reader(self) -> DecordReader | None:
        if self._decord is None and self._reopen_decord:
            self._reopen_decord = False
            try:
                self._decord = DecordReader(self._file)
            except Exception:  # noqa: BLE001 - as at loading: a decoder that cannot open leaves OpenCV alone
                self._decord = None
        return self._decord

    def __getstate__(self) -> dict[str, Any]:
        """What reopens this decoder in another process (pickle): the file, its fps and the backends it reads
        with; no open reader (the copy opens each on first use)."""
        return {
            "file": Path(self._file).absolute(),
            "fps": self._fps,
            "decord": self._decord is not None or self._reopen_decord,
            "use_cv2": self._use_cv2,
            "used": set(self.used),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["file"], state["fps"], None, state["use_cv2"])
        self._reopen_decord = state["decord"]
        self.used = state["used"]

    @property
    def file(self) -> Path:
        return Path(self._file)

    def _read_cv2(self, index: int) -> np.ndarray | None:
        if not self._use_cv2:
            return None
        if self._opencv is None:
            try:
                self._opencv = OpenCVReader(self._file, self._fps)
            except OSError:
                self._use_cv2 = False
                return None
        frame = self._opencv.read(index)
        if frame is not None:
            self.used.add("opencv")
        return frame

    def _leave_inherited_readers(self) -> None:
        """In a forked child: hand the parent's open readers to `_INHERITED` (never freed there) and open this
        decoder's own on first use."""
        if self._opencv is not None:
            _INHERITED.append(self._opencv)
            self._opencv = None
        if self._decord is not None:
            _INHERITED.append(self._decord)
            self._decord, self._reopen_decord = None, True

    def close(self) -> None:
        if self._opencv is not None:
            self._opencv.close()
        self._decord = self._opencv = None
        self._reopen_decord = False


#: every FrameDecoder of this process, weakly (garbage not yet collected included, until it is)
_DECODERS: weakref.WeakSet[FrameDecoder] = weakref.WeakSet()
#: in a forked child, the open readers it inherited: referenced here so that nothing frees them there
_INHERITED: list[Any] = []


def _after_fork_in_child() -> None:
    """A forked child (a ZeroGPU call's worker) holds the parent's open video readers but not their decoding
    threads: freeing one there (a chat's video garbage-collected in the child) waits on those threads forever.
    So each is kept, unfreed, and its decoder opens a reader of its own when the child reads a frame."""
    for decoder in list(_DECODERS):
        decoder._leave_inherited_readers()


os.register_at_fork(after_in_child=_after_fork_in_child)
