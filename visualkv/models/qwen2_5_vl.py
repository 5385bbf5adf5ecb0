"""Qwen2.5-VL (and Qwen2-VL) adapter.

An image is one grid of (H/28) x (W/28) tokens, its unit one token row; a video's unit is one temporal patch
(two frames). Image rows are encoded as horizontal strips aligned to the vision tower's window grid, with the
strip's true row offset fed to the vision RoPE, so only the few full-attention vision layers see a strip instead
of the image; a block holding the whole image, and every video block, is exact. Encoding ahead puts the strips
the next blocks read in one tower call as separate sequences. Details: docs/METHODS.md#model-families.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from visualkv.devices import to_device
from visualkv.layout import FrameInfo, VisualLayout, VisualUnit, consecutive_runs, grid_boxes
from visualkv.media import Media
from visualkv.models import compat
from visualkv.models.base import (
    ModelAdapter,
    PreparedInput,
    in_chunks,
    processor_size,
    resize_like_processor,
    splice_runs,
    text_positions,
    video_metadata,
)

#: vision towers whose forward takes its grid-derived tensors precomputed (`Qwen25VLAdapter._grid_inputs`)
PRECOMPUTED_TOWERS = ("Qwen2_5_VisionTransformerPretrainedModel", "Qwen3VLVisionModel")

#: temporal patches (2 frames each) per call to the video processor: it holds about four float32 copies of the
#: frames it is given, so a bulk prefill of a video called it on every frame at once (700 MB for 64 frames of
#: 640 x 360 on the bench model, scripts/guard_check.py); in chunks only the output grows with the video
VIDEO_CHUNK = 4


class Qwen25VLAdapter(ModelAdapter):
    family = "qwen2_5_vl"
    default_block_size = 784  # best block size for Qwen2.5-VL-7B in the block-wise paper
    vision_prep_copies = 1.5  # the processor's rescale/normalize and patchify of a strip: 1.5 copies measured
    vision_video_prep_copies = 4.0  # its video processor on a chunk's frames: 3.5-3.9 measured (Qwen2.5/3-VL)
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
        self._ahead_strips: dict[tuple[int, int], torch.Tensor] = {}  # (row0, row1) -> embeddings, encoded ahead
        self._ahead_frames: dict[int, torch.Tensor] = {}  # temporal patch -> embeddings, encoded ahead

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    @property
    def visual(self) -> torch.nn.Module:
        return self.model.model.visual

    def rotary(self, hidden, positions):
        return compat.rotary_tables(self.language_model, hidden, to_device(positions, hidden.device)[:, None, :])

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
            positions, _ = compat.rope_index(
                self.model,
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
        return compat.smart_resize(
            height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge
        )

    @staticmethod
    def resize_with(video_processor: Any, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        vp = video_processor
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
        self._ahead_strips, self._ahead_frames = {}, {}

    def encodes_ahead(self, prepared: PreparedInput) -> bool:
        return True

    @torch.no_grad()
    def encode_ahead(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> None:
        """Encode the strips / temporal patches that `encode_units` on each group in turn will ask for, in one
        tower call (see the module docstring); held until asked for. A group that holds a whole image is one
        exact call of its own: nothing is batched then."""
        units = [u for group in groups for u in group]
        vision = prepared.vision_inputs
        if units and all(u.kind == "frame" for u in units):
            frames = sorted({u.frame for u in units} - set(self._ahead_frames))
            if len(frames) > 1:
                self._frames_ahead(frames, vision)
        elif units and all(u.kind == "rows" for u in units):
            strips = self._strips_ahead(groups, prepared.layout.frames[0].grid[0])
            if len(strips) > 1:
                self._encode_strips(strips, vision)

    def _frames_ahead(self, frames: list[int], vision: dict) -> None:
        _t, gh, gw = (int(x) for x in vision["video_grid_thw"][0])
        pixels = torch.cat([self._video_pixels(vision, f0, f1) for f0, f1 in consecutive_runs(frames)])
        # one grid entry per temporal patch would be the same: the tower never attends across temporal patches
        out = self._run_visual(pixels, torch.tensor([[len(frames), gh, gw]]))
        self._ahead_frames.update(zip(frames, out.split(out.shape[0] // len(frames))))

    def _strips_ahead(self, groups: list[list[VisualUnit]], n_rows: int) -> list[tuple[int, int]]:
        """The strips not yet encoded that `encode_units` on each group in turn reads, in order."""
        current = self._strip[:2] if self._strip is not None else None
        strips: list[tuple[int, int]] = []
        for units in groups:
            rows = [u.row for u in units]
            if not rows:
                continue
            if rows[0] == 0 and rows[-1] == n_rows - 1:
                return []  # a whole image (pruned rows or not) is encoded whole, exactly: nothing to batch
            for r0, r1 in consecutive_runs(rows):
                steps, current = self._strip_steps(r0, r1, current, n_rows)
                strips += [(s0, s1) for s0, s1, new, _, _ in steps if new and (s0, s1) not in self._ahead_strips]
        return strips

    def vision_call_patches(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Image rows are encoded in strips of whole vision windows (`window_rows` token rows), a strip per
        block; blocks encoded ahead put their strips in one call. A strip that two blocks read is counted for
        both (it is encoded once): on CPU the strips' pixels pass through more float copies than the one
        `memory_guard` counts, and the excess covers them (scripts/guard_check.py). Video: the blocks'
        temporal patches."""
        tokens = 0
        for units in groups:
            if units and all(u.kind == "rows" for u in units):
                first, last, w = min(u.row for u in units), max(u.row for u in units) + 1, self.window_rows
                rows = -(-last // w) * w - first // w * w  # the whole windows these rows lie in
                tokens += rows * max(u.seq_end - u.seq_start for u in units)
            else:
                tokens += sum(u.seq_end - u.seq_start for u in units)
        return tokens * self.patches_per_token

    def _strip_steps(
        self, r0: int, r1: int, current: tuple[int, int] | None, n_rows: int
    ) -> tuple[list[tuple[int, int, bool, int, int]], tuple[int, int] | None]:
        """How rows [r0, r1) are read given the buffered strip `current` ((row0, row1) or None): per strip
        (row0, row1, whether it is encoded here, first row taken, row after the last), and the strip left
        buffered. Strips are whole vision windows, each encoded once."""
        w = self.window_rows
        steps, r = [], r0
        while r < r1:
            new = current is None or not (current[0] <= r < current[1])
            if new:
                s0 = (r // w) * w
                current = (s0, min(n_rows, max(s0 + w, -(-r1 // w) * w)))
            take = min(r1, current[1])
            steps.append((*current, new, r, take))
            r = take
            if take == current[1]:
                current = None  # fully read: freed
        return steps, current

    def _encode_strips(self, strips: list[tuple[int, int]], vision: dict) -> None:
        """Strips [row0, row1) in one tower call, one grid entry each (attention never crosses entries)."""
        _, _, gw = (int(x) for x in vision["image_grid_thw"][0])
        pixels = torch.cat([self._pixels_rows(vision, s0, s1) for s0, s1 in strips])
        grid = torch.tensor([[1, (s1 - s0) * self.merge, gw] for s0, s1 in strips])
        out = self._run_visual(pixels, grid, row_offset=[s0 for s0, _ in strips])
        cols = gw // self.merge
        self._ahead_strips.update(zip(strips, out.split([(s1 - s0) * cols for s0, s1 in strips])))

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
        return torch.cat([self._encode_rows(r0, r1, prepared.vision_inputs) for r0, r1 in consecutive_runs(rows)])

    def _run_visual(
        self, pixels: torch.Tensor, grid: torch.Tensor, row_offset: int | Sequence[int] = 0
    ) -> torch.Tensor:
        """Vision tower on the pixel patches of `grid`'s entries; the processor's host tensors move to the
        tower's device. row_offset: each entry's first token row in the image (one int for one entry)."""
        device = self.visual.patch_embed.proj.weight.device  # the tower's own device (may differ under device_map)
        offsets = [row_offset] if isinstance(row_offset, int) else list(row_offset)
        position_ids = None
        if any(offsets):
            position_ids = get_vision_position_ids(grid, self.merge)  # (patches, 2): entries one after another
            starts = [0, *grid.prod(-1).cumsum(0).tolist()]
            for i, offset in enumerate(offsets):
                position_ids[starts[i] : starts[i + 1], 0] += offset * self.merge  # the strip's true patch rows
        kwargs = _on_device(self._grid_inputs(grid, position_ids), device)
        out = self.visual(pixels.to(device, self.visual.dtype), grid_thw=grid.to(device), **kwargs)
        return out.pooler_output.to(self.device, self.dtype)

    def _grid_inputs(self, grid: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, Any]:
        """What the tower derives from its grid, computed here from the host grid (`position_ids` given or not).

        Inside the tower, on the device's copy of the grid, transformers' helpers read it back per call
        (`tolist`, `unique_consecutive`, `.item()` for flash's longest chunk): host syncs on a GPU. The towers in
        `PRECOMPUTED_TOWERS` take them precomputed (the helpers pop them from the forward's keyword arguments).
        """
        inputs: dict[str, Any] = {} if position_ids is None else {"position_ids": position_ids}
        visual = self.visual
        if type(visual).__name__ not in PRECOMPUTED_TOWERS:
            return inputs
        inputs.setdefault("position_ids", get_vision_position_ids(grid, self.merge))
        inputs["cu_seqlens"] = get_vision_cu_seqlens(grid)
        inputs["max_seqlen"] = _longest(inputs["cu_seqlens"])
        if getattr(visual, "window_size", None):  # Qwen2.5-VL's windows
            inputs["window_index"], inputs["cu_window_seqlens"] = get_vision_window_index(
                grid, spatial_merge_size=self.merge, window_size=visual.window_size, patch_size=visual.patch_size
            )
            inputs["max_window_seqlen"] = _longest(inputs["cu_window_seqlens"])
        return inputs

    def _encode_frames(self, frames: list[int], vision: dict) -> torch.Tensor:
        if frames and all(f in self._ahead_frames for f in frames):
            return torch.cat([self._ahead_frames.pop(f) for f in frames])
        for f in frames:
            self._ahead_frames.pop(f, None)
        _t, gh, gw = (int(x) for x in vision["video_grid_thw"][0])
        f0, f1 = frames[0], frames[-1] + 1
        if frames != list(range(f0, f1)):  # non-contiguous (skipped frames): encode runs
            return torch.cat([self._encode_frames([f], vision) for f in frames])
        pixels = self._video_pixels(vision, f0, f1)
        grid = torch.tensor([[f1 - f0, gh, gw]])
        return self._run_visual(pixels, grid)

    def video_patches_per_call(self, prepared: PreparedInput) -> int | None:
        _, gh, gw = (int(x) for x in prepared.vision_inputs["video_grid_thw"][0])
        return VIDEO_CHUNK * gh * gw  # `_video_pixels`

    def _video_pixels(self, vision: dict, t0: int, t1: int) -> torch.Tensor:
        """`_pixels_frames` of temporal patches [t0, t1), `VIDEO_CHUNK` at a time, written into one tensor: the
        same values (each temporal patch is processed on its own), with the processor's copies of a chunk only."""
        return in_chunks(t1 - t0, VIDEO_CHUNK, lambda i0, i1: self._pixels_frames(vision, t0 + i0, t0 + i1))

    def _encode_rows(self, r0: int, r1: int, vision: dict) -> torch.Tensor:
        _, gh, gw = (int(x) for x in vision["image_grid_thw"][0])
        rows, cols = gh // self.merge, gw // self.merge
        tokens_per_row = cols
        if r0 == 0 and r1 == rows:  # whole image: exactly what transformers does
            return self._run_visual(self._pixels_rows(vision, 0, rows), vision["image_grid_thw"])
        parts = []
        steps, _ = self._strip_steps(r0, r1, self._strip[:2] if self._strip is not None else None, rows)
        for s0, s1, new, r, take in steps:
            if new:
                emb = self._ahead_strips.pop((s0, s1), None)
                if emb is None:
                    pixels = self._pixels_rows(vision, s0, s1)
                    emb = self._run_visual(pixels, torch.tensor([[1, (s1 - s0) * self.merge, gw]]), row_offset=s0)
                self._strip = (s0, s1, emb)
            emb = self._strip[2]
            parts.append(emb[(r - s0) * tokens_per_row : (take - s0) * tokens_per_row])
            if take == s1:
                self._strip = None  # fully consumed: free it
        return torch.cat(parts)


def _longest(cu_seqlens: torch.Tensor) -> int:
    """The longest chunk of host boundaries (what flash attention's varlen call is given)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _on_device(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of `inputs` on `device` (no stream synchronisation), other values as they are."""
    return {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _as_tensor(x):
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x)
