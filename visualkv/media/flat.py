"""Flat-video detection: every sampled frame one colour is what a video whose picture data was zeroed or
lost decodes to, so the user is told instead of getting answers about a blank video."""

from __future__ import annotations

import numpy as np


def is_flat(frame: np.ndarray, tolerance: int = 2) -> bool:
    """Every channel of an (H, W, 3) frame one value, within `tolerance` levels: what a video whose picture data
    was zeroed or lost decodes to (the decoder's grey). A sparse grid of pixels is tried first, so a frame with
    content costs next to nothing."""
    for sample in (frame[::16, ::16], frame):
        pixels = sample.reshape(-1, sample.shape[-1])
        if int((pixels.max(axis=0).astype(np.int16) - pixels.min(axis=0)).max()) > tolerance:
            return False
    return True


def flat_video_note(name: str) -> str:
    return (
        f"'{name}': every sampled frame is one flat colour, so its picture data is likely damaged (the model "
        "sees a blank video) — re-download or re-encode it"
    )


class FlatWatch:
    """Says once, in the Media's warnings, that every sampled frame of a lazily decoded video is flat (`is_flat`),
    when the last of them has been decoded; looks no further once a frame with content is seen."""

    def __init__(self, name: str, frames: int, notes: list[str]) -> None:
        self.name, self.frames, self.notes = name, frames, notes
        self.flat: set[int] = set()  # positions decoded so far, all flat
        self.done = False  # a frame with content was seen, or the warning was given

    def saw(self, k: int, frame: np.ndarray) -> None:
        if self.done or k in self.flat:
            return
        if not is_flat(frame):
            self.done = True
            return
        self.flat.add(k)
        if len(self.flat) == self.frames:
            self.notes.append(flat_video_note(self.name))
            self.done = True
