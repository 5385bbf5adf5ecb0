"""Qwen2.5-VL (and Qwen2-VL) adapter.

Layout: an image is one grid of (H/28) x (W/28) tokens; its unit is one
token-grid row. A video is a sequence of temporal patches (2 sampled frames
each); its unit is one temporal patch.

Streamed vision encoding. The vision tower attends inside 112-px windows in
most layers and over the whole image in a few (`fullatt_block_indexes`).
Images are encoded in horizontal strips aligned to the window grid, with the
strip's true row offset fed to the vision RoPE, so the windowed layers are
exact; only the full-attention layers see the strip instead of the whole image
(the one inexact step, measured in the tests and the README). Leftover rows of
a strip are buffered for the next block, so each strip is encoded once. When a
block holds a whole image it is encoded in one call, exactly as transformers
does. Videos are exact block by block: their attention never crosses a
temporal patch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize
from transformers.vision_utils import get_vision_position_ids

from visualkv.layout import FrameInfo, VisualLayout, VisualUnit, grid_boxes
from visualkv.media import Media
from visualkv.models.base import (
    ModelAdapter,
    PreparedInput,
    processor_size,
    resize_like_processor,
    splice_runs,
    text_positions,
    video_metadata,
)
from visualkv.models.vision_attention import batch_vision_chunks


class Qwen25VLAdapter(ModelAdapter):
    family = "qwen2_5_vl"
    default_block_size = 784  # best block size for Qwen2.5-VL-7B in the block-wise paper
    position_axes = 3

    def __init__(self, model, processor, name: str) -> None:
        super().__init__(model, processor, name)
        vcfg = model.config.vision_config
        self.merge = vcfg.spatial_merge_size
        # Qwen2.5-VL attends in windows of window_size px in most vision layers; Qwen2-VL has no
        # windows (every layer sees the whole image), so any strip is approximate there.
        window = getattr(vcfg, "window_size", None)
        self.window_rows = max(1, window // vcfg.patch_size // self.merge) if window else 1
        self._strip: tuple[int, int, torch.Tensor] | None = None  # (row0, row1, embeddings)
        batch_vision_chunks(self.visual)  # one attention call per window length, not per window

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    @property
    def visual(self) -> torch.nn.Module:
        return self.model.model.visual

    def rotary(self, hidden, positions):
        return self.language_model.rotary_emb(hidden, positions.to(hidden.device)[:, None, :])

    # -- tokenization -------------------------------------------------------------
    def prepare(self, media: Media | None, prompt: str) -> PreparedInput:
        text = self.chat_text(media, prompt)
        if media is None:
            enc = self.processor(text=[text], return_tensors="pt")
        elif media.kind == "image":
            enc = self._prepare_image_lazily(text, media.frames[0])
        else:
            enc = self._prepare_video_lazily(text, media)
        ids = enc["input_ids"][0]
        cfg = self.model.config
        mm_types = torch.zeros_like(ids, dtype=torch.int32)
        mm_types[ids == cfg.image_token_id] = 1
        mm_types[ids == cfg.video_token_id] = 2
        visual_mask = mm_types > 0
        if media is None:
            positions = text_positions(0, ids.shape[0], 3)
            layout = VisualLayout.empty()
            vision = {}
        else:
            positions, _ = self.model.model.get_rope_index(
                ids[None],
                mm_token_type_ids=mm_types[None],
                image_grid_thw=enc.get("image_grid_thw"),
                video_grid_thw=enc.get("video_grid_thw"),
                second_per_grid_ts=_as_tensor(enc.get("second_per_grid_ts")),
            )
            positions = positions[:, 0]
            vision = {k: enc[k] for k in ("resized_image", "image_grid_thw", "video", "video_grid_thw") if k in enc}
            layout = self._layout(media, visual_mask, vision)
        visual_idx = visual_mask.nonzero().flatten()
        suffix = int(visual_idx[-1]) + 1 if visual_idx.numel() else ids.shape[0]
        self.reset_stream()
        return PreparedInput(
            input_ids=ids,
            position_ids=positions.long(),
            next_position=int(positions.max()) + 1,
            visual_mask=visual_mask,
            layout=layout,
            suffix_start=suffix,
            vision_inputs=vision,
            media=media,
        )

    def _prepare_image_lazily(self, text: str, frame: np.ndarray) -> dict[str, Any]:
        """Tokens and the resized image, without materialising all pixel patches.

        Mirrors the processor: the image is resized once (uint8, by the image
        processor's own resize), and `_pixels_rows` normalises and patchifies
        only the rows a block needs; the token text gets one image pad per
        merged patch, as the processor's `replace_image_token` does. A test
        checks both against the processor's own output.
        """
        ip = self.processor.image_processor
        image = torch.from_numpy(np.require(frame, requirements=["C", "W"])).permute(2, 0, 1)[None]
        factor = ip.patch_size * ip.merge_size
        resized = ip.resize(images=image, size=processor_size(ip), resample=ip.resample, factor=factor)
        grid_h, grid_w = resized.shape[-2] // ip.patch_size, resized.shape[-1] // ip.patch_size
        n_tokens = grid_h * grid_w // (ip.merge_size**2)
        ids = splice_runs(self.tokenizer, text, self.processor.image_token, [n_tokens])[None]
        return {"input_ids": ids, "resized_image": resized, "image_grid_thw": torch.tensor([[1, grid_h, grid_w]])}

    def _prepare_video_lazily(self, text: str, media: Media) -> dict[str, Any]:
        """Tokens and grid of a video, without materialising every frame's pixel patches.

        The video processor resizes and patchifies each temporal patch (2
        frames) on its own, so processing one patch at a time (`_pixels_frames`)
        gives exactly its slice of the whole video's tensor (a test checks it).
        Here only the first patch is processed, for the grid.
        """
        vp = self.processor.video_processor
        # the vision side reads frames resized at decode (where they shrink); the processor gives them the
        # same grid and pixels as the decoded frames (tests/test_frame_resize.py)
        frames = self.video_for_encoding(media)
        first = self._pixels_frames({"media": frames}, 0, 1, with_grid=True)
        _, gh, gw = (int(x) for x in first["video_grid_thw"][0])
        t = -(-len(media.frames) // vp.temporal_patch_size)
        n_tokens = t * gh * gw // (vp.merge_size**2)
        # one pad per visual token, spliced in as ids (never a 540k-token string through the tokenizer)
        ids = splice_runs(self.tokenizer, text, self.processor.video_token, [n_tokens])[None]
        fps = video_metadata(media).sampled_fps
        return {
            "input_ids": ids,
            "video": frames,
            "video_grid_thw": torch.tensor([[t, gh, gw]]),
            "second_per_grid_ts": torch.tensor([vp.temporal_patch_size / fps]),
        }

    def video_frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int] | None:
        """The processor's `smart_resize` of one frame (its per-frame pixel cap; the total cap is off, see
        `_pixels_frames`)."""
        vp = self.processor.video_processor
        if not vp.do_resize:
            return None
        size = processor_size(vp)
        factor = vp.patch_size * vp.merge_size
        return smart_resize(height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge)

    def resize_video_frame(self, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        vp = self.processor.video_processor
        # the processor's resize computes `size` again from the frame (smart_resize) and resizes with
        # torchvision (uint8 in and out); the same call on one frame gives the same uint8 pixels
        no_total_cap = {"cap_pixels_per_frame": False} if hasattr(vp, "cap_pixels_per_frame") else {}
        factor = vp.patch_size * vp.merge_size
        return resize_like_processor(vp, frame, factor=factor, temporal_factor=vp.temporal_patch_size, **no_total_cap)

    def _pixels_frames(self, vision: dict, t0: int, t1: int, with_grid: bool = False):
        """Pixel patches of temporal patches [t0, t1), through the processor's own video pipeline."""
        media: Media = vision.get("video") or vision["media"]
        tp = self.processor.video_processor.temporal_patch_size
        frames = media.frames[t0 * tp : t1 * tp]
        sub = Media(
            kind="video",
            frames=frames,
            times=media.times[t0 * tp : t1 * tp],
            source_fps=media.source_fps,
            duration=media.duration,
            path=None,
        )
        vp = self.processor.video_processor
        # transformers' optional total-pixel cap (`cap_pixels_per_frame`) shrinks frames by the frame
        # count of the call, so blocks of a few frames would be resized unlike the whole video. Keep
        # it off explicitly (also silences its deprecation warning); frame sampling bounds the total.
        no_total_cap = {"cap_pixels_per_frame": False} if hasattr(vp, "cap_pixels_per_frame") else {}
        out = vp(
            videos=[np.stack(frames)],
            video_metadata=[video_metadata(sub)],
            do_sample_frames=False,
            return_tensors="pt",
            **no_total_cap,
        )
        return out if with_grid else out["pixel_values_videos"]

    def _pixels_rows(self, vision: dict, r0: int, r1: int) -> torch.Tensor:
        """Pixel patches (n_patches, C*T*P*P) of merged token rows [r0, r1), exactly as the processor."""
        ip = self.processor.image_processor
        band = ip.patch_size * ip.merge_size
        crop = vision["resized_image"][:, :, r0 * band : r1 * band]
        crop = ip.rescale_and_normalize(
            crop, ip.do_rescale, ip.rescale_factor, ip.do_normalize, ip.image_mean, ip.image_std
        )
        patches, _, _ = ip.patchify(
            crop, patch_size=ip.patch_size, merge_size=ip.merge_size, temporal_patch_size=ip.temporal_patch_size
        )
        return patches[0]

    def followup_ids(self, prompt: str) -> torch.Tensor:
        text = f"<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def _layout(self, media: Media, visual_mask: torch.Tensor, vision: dict) -> VisualLayout:
        seq_index = visual_mask.nonzero().flatten().numpy()
        width, height = media.size
        if media.kind == "image":
            _, gh, gw = (int(x) for x in vision["image_grid_thw"][0])
            rows, cols, t = gh // self.merge, gw // self.merge, 1
            frames = [FrameInfo("image", (rows, cols), 0.0, (0,), (0, 0, width, height))]
        else:
            t, gh, gw = (int(x) for x in vision["video_grid_thw"][0])
            rows, cols = gh // self.merge, gw // self.merge
            n_src = len(media.frames)
            frames = []
            for i in range(t):
                src = tuple(j for j in (2 * i, 2 * i + 1) if j < n_src) or (n_src - 1,)
                frames.append(FrameInfo("frame", (rows, cols), media.times[src[0]], src, (0, 0, width, height)))
        per = rows * cols
        frame = np.repeat(np.arange(t), per)
        r = np.tile(np.repeat(np.arange(rows), cols), t)
        c = np.tile(np.tile(np.arange(cols), rows), t)
        box = np.tile(grid_boxes(rows, cols, (0, 0, width, height)), (t, 1))
        units: list[VisualUnit] = []
        for f in range(t):
            base = f * per
            if media.kind == "image":
                for row in range(rows):
                    s = seq_index[base + row * cols]
                    units.append(VisualUnit("rows", f, int(s), int(s) + cols, row=row))
            else:
                s = seq_index[base]
                units.append(VisualUnit("frame", f, int(s), int(s) + per))
        return VisualLayout(seq_index, frame, r, c, box, frames, units, (width, height), media.kind)

    # -- vision -------------------------------------------------------------------
    def reset_stream(self) -> None:
        self._strip = None

    @torch.no_grad()
    def encode_units(self, prepared: PreparedInput, units: list[VisualUnit]) -> torch.Tensor:
        if not units:
            return torch.zeros((0, self.text_config.hidden_size), dtype=self.dtype, device=self.device)
        if units[0].kind == "frame":
            return self._encode_frames([u.frame for u in units], prepared.vision_inputs)
        rows = [u.row for u in units]
        n_rows, cols = prepared.layout.frames[0].grid
        if rows[0] == 0 and rows[-1] == n_rows - 1 and len(rows) < n_rows:
            # a whole image with some fully pruned rows: encode it whole (exact), keep the rows asked for
            whole = self._encode_rows(0, n_rows, prepared.vision_inputs).view(n_rows, cols, -1)
            return whole[torch.tensor(rows)].reshape(len(rows) * cols, -1)
        # otherwise rows whose every token was pruned are absent: encode each consecutive run
        parts, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                parts.append(self._encode_rows(rows[start], rows[i - 1] + 1, prepared.vision_inputs))
                start = i
        return torch.cat(parts)

    def _run_visual(self, pixels: torch.Tensor, grid: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
        """Vision tower on pixel patches of one grid; the processor's host tensors move to the tower's device."""
        device = self.visual.patch_embed.proj.weight.device  # the tower's own device (may differ under device_map)
        grid = grid.to(device)
        kwargs: dict[str, Any] = {}
        if row_offset:
            pos = get_vision_position_ids(grid, self.merge)
            pos[:, 0] += row_offset * self.merge  # the strip's true patch rows in the image
            kwargs["position_ids"] = pos.to(device)
        out = self.visual(pixels.to(device, self.visual.dtype), grid_thw=grid, **kwargs)
        return out.pooler_output.to(self.device, self.dtype)

    def _encode_frames(self, frames: list[int], vision: dict) -> torch.Tensor:
        _t, gh, gw = (int(x) for x in vision["video_grid_thw"][0])
        f0, f1 = frames[0], frames[-1] + 1
        if frames != list(range(f0, f1)):  # non-contiguous (skipped frames): encode runs
            return torch.cat([self._encode_frames([f], vision) for f in frames])
        pixels = self._pixels_frames(vision, f0, f1)
        grid = torch.tensor([[f1 - f0, gh, gw]])
        return self._run_visual(pixels, grid)

    def _encode_rows(self, r0: int, r1: int, vision: dict) -> torch.Tensor:
        _, gh, gw = (int(x) for x in vision["image_grid_thw"][0])
        rows, cols = gh // self.merge, gw // self.merge
        tokens_per_row = cols
        if r0 == 0 and r1 == rows:  # whole image: exactly what transformers does
            return self._run_visual(self._pixels_rows(vision, 0, rows), vision["image_grid_thw"])
        parts = []
        r = r0
        while r < r1:
            if self._strip is None or not (self._strip[0] <= r < self._strip[1]):
                s0 = (r // self.window_rows) * self.window_rows
                s1 = min(
                    rows,
                    max(s0 + self.window_rows, ((r1 + self.window_rows - 1) // self.window_rows) * self.window_rows),
                )
                pixels = self._pixels_rows(vision, s0, s1)
                grid = torch.tensor([[1, (s1 - s0) * self.merge, gw]])
                self._strip = (s0, s1, self._run_visual(pixels, grid, row_offset=s0))
            s0, s1, emb = self._strip
            take = min(r1, s1)
            parts.append(emb[(r - s0) * tokens_per_row : (take - s0) * tokens_per_row])
            r = take
            if take == s1:
                self._strip = None  # fully consumed: free it
        return torch.cat(parts)


def _as_tensor(x):
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x)
