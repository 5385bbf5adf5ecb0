"""Qwen3-VL adapter (`Qwen3VLForConditionalGeneration`), extending the Qwen2.5-VL one.

Differences: 16-px patches merged 2x2, interleaved M-RoPE, global vision attention with a learned position table
resampled to the whole grid, a video unit of one temporal patch with its timestamp text, and DeepStack features
(merged features of some vision blocks, added after the first LLM layers), returned per block with the
embeddings. Internally the vision output is packed as [embedding | deepstack_1 | ... | deepstack_k] so the row
and strip logic inherited from Qwen2.5-VL carries a token's features together. Details:
docs/METHODS.md#model-families.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.image_utils import SizeDict
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from visualkv.layout import VisualUnit
from visualkv.media import Media
from visualkv.models import compat
from visualkv.models.base import PreparedInput, frame_as_video, tokenize_runs, video_as_frame, video_metadata
from visualkv.models.qwen2_5_vl import Qwen25VLAdapter, _on_device


class Qwen3VLAdapter(Qwen25VLAdapter):
    family = "qwen3_vl"
    # Units are token rows (images) or temporal patches (video) of varying size; Qwen2.5-VL's best
    # block size from the block-wise paper is kept (no Qwen3-VL figure there).
    default_block_size = 784

    def __init__(self, model, processor, name: str) -> None:
        super().__init__(model, processor, name)
        self.window_rows = 1  # no windowed vision attention: a strip is exactly the rows a block asks for
        self._image_grid: torch.Tensor | None = None  # the whole image's grid while encoding its rows

    # -- tokenization -------------------------------------------------------------
    def _prepare_video_lazily(self, text: str, media: Media) -> dict[str, Any]:
        """Tokens (timestamps between frames) and grid of a video, without processing pixels.

        The size every frame is resized to depends on the whole clip (the processor's `smart_resize`
        over all frames, per-frame cap off), so it is computed here once; the grid carries it to the blocks.
        """
        vp = self.processor.video_processor
        w, h = media.size
        rh, rw = self._clip_frame_size(h, w, len(media.frames))
        t = -(-len(media.frames) // vp.temporal_patch_size)
        grid = torch.tensor([[t, rh // vp.patch_size, rw // vp.patch_size]])
        expansion = self.processor.replace_video_token(
            {"video_grid_thw": grid, "video_metadata": [video_metadata(media)]}, 0
        )
        # the pad runs are spliced in as ids (an hour of video is ~540k pads: never tokenized as text)
        ids = tokenize_runs(
            self.tokenizer, text.replace(self.processor.video_token, expansion, 1), self.processor.video_token
        )[None]
        # the vision side reads frames resized at decode to that size (where they shrink)
        return {"input_ids": ids, "video": self.video_for_encoding(media), "video_grid_thw": grid}

    def _clip_frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """(height, width) of every frame of the clip: the processor's `smart_resize` over all its frames."""
        vp = self.processor.video_processor
        size = vp.size if isinstance(vp.size, SizeDict) else SizeDict(**dict(vp.size))
        return compat.qwen3_smart_resize(
            num_frames=num_frames,
            height=height,
            width=width,
            temporal_factor=vp.temporal_patch_size,
            factor=vp.patch_size * vp.merge_size,
            min_pixels=size.shortest_edge,
            max_pixels=size.longest_edge,
        )

    def video_frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int] | None:
        return self._clip_frame_size(height, width, num_frames)

    @staticmethod
    def resize_with(video_processor: Any, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        # the resize `_pixels_frames` applies to a block's frames, on one frame (uint8 in and out)
        vp = video_processor
        out = super(type(vp), vp).resize(
            frame_as_video(frame), size=SizeDict(height=size[0], width=size[1]), resample=vp.resample
        )
        return video_as_frame(out)

    def _pixels_frames(self, vision: dict, t0: int, t1: int, with_grid: bool = False):
        """Pixel patches of temporal patches [t0, t1): resized to the whole clip's size, then the processor."""
        media: Media = vision["video"]
        vp = self.processor.video_processor
        tp = vp.temporal_patch_size
        frames = torch.from_numpy(np.stack(media.frames[t0 * tp : t1 * tp])).permute(0, 3, 1, 2)[None]
        _, gh, gw = (int(x) for x in vision["video_grid_thw"][0])
        rh, rw = gh * vp.patch_size, gw * vp.patch_size  # the whole clip's resized size
        # the base video processor's resize: the one Qwen3VLVideoProcessor.resize calls with its own size
        resized = super(type(vp), vp).resize(frames, size=SizeDict(height=rh, width=rw), resample=vp.resample)
        sub = Media(
            kind="video",
            frames=list(resized[0].permute(0, 2, 3, 1).numpy()),
            times=media.times[t0 * tp : t1 * tp],
            source_fps=media.source_fps,
            duration=media.duration,
            path=None,
        )
        out = vp(
            videos=[resized[0]],
            video_metadata=[video_metadata(sub)],
            do_sample_frames=False,
            do_resize=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
        return out if with_grid else out["pixel_values_videos"]

    # -- vision -------------------------------------------------------------------
    def encode_units_with_layer_features(
        self, prepared: PreparedInput, units: list[VisualUnit]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embeddings (n, d) and one DeepStack feature (n, d) per early LLM layer."""
        packed = super().encode_units(prepared, units)
        parts = packed.split(self.text_config.hidden_size, dim=-1)
        return parts[0], list(parts[1:])

    def encode_units(self, prepared: PreparedInput, units: list[VisualUnit]) -> torch.Tensor:
        return self.encode_units_with_layer_features(prepared, units)[0]

    def _encode_rows(self, r0: int, r1: int, vision: dict) -> torch.Tensor:
        self._image_grid = vision["image_grid_thw"]
        try:
            return super()._encode_rows(r0, r1, vision)
        finally:
            self._image_grid = None

    def _encode_strips(self, strips: list[tuple[int, int]], vision: dict) -> None:
        self._image_grid = vision["image_grid_thw"]
        try:
            super()._encode_strips(strips, vision)
        finally:
            self._image_grid = None

    def _run_visual(
        self, pixels: torch.Tensor, grid: torch.Tensor, row_offset: int | Sequence[int] = 0
    ) -> torch.Tensor:
        """Packed [embedding | deepstack...] (n, d * (1 + k)) of the patches in `pixels`; the processor's host
        tensors (pixels, grid, strip positions) move to the tower's own device (may differ under device_map)."""
        device = self.visual.patch_embed.proj.weight.device
        whole = self._image_grid
        strip = whole is not None and not torch.equal(grid, whole)
        # A strip of token rows: rotary ids and resampled learned position embeddings of its true place in the
        # whole image (patches are in merge-block order, so a strip is a contiguous slice); else the grid's own
        visual = self.visual
        idx, weights = get_vision_interpolation_indices_and_weights(
            whole if strip else grid,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=self.merge,
        )
        position_ids = None
        if strip:
            # each grid entry is a strip: its patches are rows [offset, offset + entry rows) of the whole image
            offsets = [row_offset] if isinstance(row_offset, int) else list(row_offset)
            per_row = int(whole[0, 2]) * self.merge  # patches per token row
            rows = torch.cat(
                [torch.arange(o * per_row, o * per_row + int(n)) for o, n in zip(offsets, grid.prod(-1).tolist())]
            )
            idx, weights = idx[rows], weights[rows]
            position_ids = get_vision_position_ids(whole, self.merge)[rows]
        inputs = {**self._grid_inputs(grid, position_ids), "interp_indices": idx, "interp_weights": weights}
        kwargs = _on_device(inputs, device)
        out = self.visual(pixels.to(device, self.visual.dtype), grid_thw=grid.to(device), **kwargs)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1).to(self.device, self.dtype)
