"""SmolVLM / SmolVLM2 (Idefics3-style) adapter.

Layout: the processor splits a large image into rows x cols tiles of 512 px
plus a global thumbnail; each tile becomes an 8 x 8 grid of tokens (SigLIP
patches pixel-shuffled by 4). A video is a list of frames, each one 8 x 8
tile with a text timestamp before it. The unit is one tile / frame.

Every tile and frame is encoded independently by the vision tower, so
block-by-block encoding is exact. Tile pixel boxes assume the processor's even
split of the resized image into rows x cols tiles (accurate to the resize
rounding, a few pixels).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from PIL import Image

from visualkv.devices import to_device
from visualkv.layout import FrameInfo, VisualLayout, VisualUnit, grid_boxes
from visualkv.media import Media
from visualkv.models import compat
from visualkv.models.base import (
    VIDEO_FRAMES_PER_CALL,
    ModelAdapter,
    PreparedInput,
    in_chunks,
    resize_like_processor,
    text_positions,
    tokenize_runs,
    video_metadata,
)

_ROW_COL = re.compile(r"<row_(\d+)_col_(\d+)>")


class SmolVLMAdapter(ModelAdapter):
    family = "smolvlm"
    units_independent = True  # tiles and frames are images of their own: several blocks' share a call
    default_block_size = 256  # four 64-token tiles
    # the block's tiles indexed out of the processor's output, then inside get_image_features a bool test of
    # every value and contiguous copies of the tiles and of their int64 per-pixel mask, all held while the
    # tower runs: 3.3 copies measured
    vision_prep_copies = vision_input_copies = 3.5
    vision_video_prep_copies = 4.5  # its video processor on a block's frames: 4.0-4.2 measured
    position_axes = 1

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.text_model

    def rotary(self, hidden, positions):
        return compat.rotary_tables(self.language_model, hidden, to_device(positions[:1], hidden.device))

    def prepare(self, media: Media | None, prompt: str) -> PreparedInput:
        text = self.chat_text(media, prompt)
        if media is not None and media.kind == "video":
            ids = self._video_ids(text, media)
            vision: dict[str, Any] = {"video": self.video_for_encoding(media)}  # frames resized at decode
        else:
            images = [[Image.fromarray(media.frames[0])]] if media is not None else None
            enc = self.processor(text=[text], images=images, return_tensors="pt")
            ids = enc["input_ids"][0]
            vision = {k: enc[k] for k in ("pixel_values", "pixel_attention_mask") if k in enc}
        visual_mask = ids == self.model.config.image_token_id
        layout = self._layout(media, ids, visual_mask) if media is not None else VisualLayout.empty()
        visual_idx = visual_mask.nonzero().flatten()
        suffix = int(visual_idx[-1]) + 1 if visual_idx.numel() else ids.shape[0]
        # Idefics3-style models number positions 0..L-1 (1-D RoPE).
        return PreparedInput(
            input_ids=ids,
            position_ids=text_positions(0, ids.shape[0], 1),
            next_position=int(ids.shape[0]),
            visual_mask=visual_mask,
            layout=layout,
            suffix_start=suffix,
            vision_inputs=vision,
            media=media,
        )

    def video_frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int] | None:
        """Video frames end square: resized to `size` (longest edge, aspect kept), then to the encoder's
        `max_image_size` square (the processor's two resizes; frames are never split into tiles)."""
        vp = self.processor.video_processor
        side = dict(vp.max_image_size).get("longest_edge")
        return (side, side) if vp.do_resize and side else None

    @staticmethod
    def resize_with(video_processor: Any, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        return resize_like_processor(video_processor, frame)  # both resizes, as the processor

    def _video_ids(self, text: str, media: Media) -> torch.Tensor:
        """Token ids of a video prompt, written by the processor's own `replace_video_token`.

        The expansion (intro, one timestamp + 64 image tokens per frame) depends
        only on the frame count and times, so no pixel is processed here; frames
        are processed per block in `_frame_pixels` (a test checks both against
        the processor's full output).
        """
        placeholder = {
            "pixel_values": torch.empty((1, len(media.frames), 0)),
            "video_metadata": [video_metadata(media)],
        }
        expansion = self.processor.replace_video_token(placeholder, 0)
        text = text.replace(self.processor.video_token, expansion, 1)
        return tokenize_runs(self.tokenizer, text, self.processor.image_token)  # pad runs spliced in as ids

    def _frame_pixels(self, media: Media, frames: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pixel_values (1, k, 3, 512, 512) and pixel_attention_mask of the given frames."""
        chosen = [media.frames[i] for i in frames]
        sub = Media(
            kind="video",
            frames=chosen,
            times=[media.times[i] for i in frames],
            source_fps=media.source_fps,
            duration=media.duration,
            path=None,
        )
        out = self.processor.video_processor(
            videos=[np.stack(chosen)], video_metadata=[video_metadata(sub)], do_sample_frames=False, return_tensors="pt"
        )
        return out["pixel_values"], out.get("pixel_attention_mask")

    def _video_pixels(self, media: Media, frames: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_frame_pixels` of the given frames, the processor seeing `VIDEO_FRAMES_PER_CALL` at a time (it
        processes each frame on its own: the same values, with its float32 intermediates of one chunk)."""
        masks: list[torch.Tensor | None] = []

        def chunk(i0: int, i1: int) -> torch.Tensor:
            pixels, mask = self._frame_pixels(media, frames[i0:i1])
            masks.append(mask)
            return pixels

        pixels = in_chunks(len(frames), VIDEO_FRAMES_PER_CALL, chunk, dim=1)
        return pixels, None if masks[0] is None else torch.cat(masks, dim=1)

    def video_patches_per_call(self, prepared: PreparedInput) -> int | None:
        return self._frame_unit_patches(prepared, VIDEO_FRAMES_PER_CALL)

    def followup_ids(self, prompt: str) -> torch.Tensor:
        text = f"<end_of_utterance>\nUser: {prompt}<end_of_utterance>\nAssistant:"
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def _layout(self, media: Media, ids: torch.Tensor, visual_mask: torch.Tensor) -> VisualLayout:
        seq_index = visual_mask.nonzero().flatten().numpy()
        runs = _runs(seq_index)
        width, height = media.size
        side = round(len(runs[0]) ** 0.5) if runs else 0
        grid_rc: list[tuple[int, int]] = []
        text = self.tokenizer.convert_ids_to_tokens(ids.tolist())
        for tok in text:
            m = _ROW_COL.fullmatch(tok) if isinstance(tok, str) else None
            if m:
                grid_rc.append((int(m.group(1)), int(m.group(2))))
        n_rows = max((r for r, _ in grid_rc), default=0)
        n_cols = max((c for _, c in grid_rc), default=0)
        frames: list[FrameInfo] = []
        boxes = []
        for i, run in enumerate(runs):
            if media.kind == "video":
                region = (0, 0, width, height)
                frames.append(FrameInfo("frame", (side, side), media.times[i], (i,), region))
            elif i < n_rows * n_cols:
                r, c = divmod(i, n_cols)
                region = (c * width / n_cols, r * height / n_rows, (c + 1) * width / n_cols, (r + 1) * height / n_rows)
                frames.append(FrameInfo("tile", (side, side), 0.0, (0,), tuple(round(v) for v in region)))
            else:
                region = (0, 0, width, height)
                frames.append(FrameInfo("global", (side, side), 0.0, (0,), region))
            boxes.append(grid_boxes(side, side, region))
        n = len(seq_index)
        frame = np.repeat(np.arange(len(runs)), side * side)
        rr = np.tile(np.repeat(np.arange(side), side), len(runs))
        cc = np.tile(np.tile(np.arange(side), side), len(runs))
        kind = "frame" if media.kind == "video" else "tile"
        units = [VisualUnit(kind, i, int(run[0]), int(run[-1]) + 1) for i, run in enumerate(runs)]
        box = np.concatenate(boxes) if boxes else np.zeros((0, 4), dtype=np.int64)
        assert frame.shape[0] == n, "visual tokens must form square tiles"
        return VisualLayout(seq_index, frame, rr, cc, box, frames, units, (width, height), media.kind)

    @torch.no_grad()
    def encode_units(self, prepared: PreparedInput, units: list[VisualUnit]) -> torch.Tensor:
        if not units:
            return torch.zeros((0, self.text_config.hidden_size), dtype=self.dtype, device=self.device)
        idx = torch.tensor([u.frame for u in units])
        if "video" in prepared.vision_inputs:  # frames are processed only when their block runs
            pv, pam = self._video_pixels(prepared.vision_inputs["video"], idx.tolist())
        else:
            pv = prepared.vision_inputs["pixel_values"][:, idx]
            pam = prepared.vision_inputs.get("pixel_attention_mask")
            pam = pam[:, idx] if pam is not None else None
        # pixels go to the vision tower's own device (it may differ from the LLM's under device_map="auto")
        vision_device = self.model.model.vision_model.embeddings.patch_embedding.weight.device
        out = self.model.model.get_image_features(
            pv.to(vision_device), pam.to(vision_device) if pam is not None else None
        )
        feats = out.pooler_output
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])
        return feats.to(self.device, self.dtype)


def _runs(seq_index: np.ndarray) -> list[np.ndarray]:
    """Split sorted indices into runs of consecutive integers."""
    if seq_index.size == 0:
        return []
    breaks = np.nonzero(np.diff(seq_index) != 1)[0] + 1
    return np.split(seq_index, breaks)
