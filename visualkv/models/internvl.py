"""InternVL3.5 adapter (`InternVLForConditionalGeneration`, the OpenGVLab `-HF` checkpoints).

Layout: the processor resizes an image to the tile grid (cols x rows of 448 px, 1..12 tiles, the grid
whose aspect ratio is closest to the image's) and appends a 448-px thumbnail of the whole image when
there is more than one tile. Each tile is 32 x 32 InternViT patches, pixel-shuffled by 0.5 to a
16 x 16 grid: 256 tokens, written tile after tile between <img> and </img>. A video is a list of
frames, each one 448-px tile ("FrameN: <img>...</img>" per frame). The unit is one tile / frame.

Every tile and frame goes through the vision tower on its own, so block-by-block encoding is exact;
video frames are preprocessed only when their block runs. Positions are 1-D; the LLM is Qwen3.
"""

from __future__ import annotations

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
    fixed_video_frame_size,
    in_chunks,
    resize_like_processor,
    text_positions,
    tokenize_runs,
)


class InternVLAdapter(ModelAdapter):
    family = "internvl"
    units_independent = True  # tiles and frames are images of their own: several blocks' share a call
    default_block_size = 1024  # four 256-token tiles
    position_axes = 1
    vision_video_prep_copies = 3.0  # its video processor on a block's frames: 2.8 measured

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    def rotary(self, hidden, positions):
        return compat.rotary_tables(self.language_model, hidden, to_device(positions[:1], hidden.device))

    @property
    def tokens_per_tile(self) -> int:
        return int(self.model.config.image_seq_length)

    @property
    def patches_per_token(self) -> int:
        # the projector's pixel shuffle packs (1 / downsample_ratio)^2 patches into one token (0.5: 4)
        return round(1 / self.model.config.downsample_ratio) ** 2

    # -- video frames resized at decode -------------------------------------------
    def video_frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int] | None:
        """Every frame is resized to the video processor's fixed height x width (one tile)."""
        return fixed_video_frame_size(self.processor.video_processor)

    @staticmethod
    def resize_with(video_processor: Any, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        return resize_like_processor(video_processor, frame)

    # -- tokenization -------------------------------------------------------------
    def prepare(self, media: Media | None, prompt: str) -> PreparedInput:
        text = self.chat_text(media, prompt)
        vision: dict[str, Any] = {}
        if media is None:
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        elif media.kind == "image":
            enc = self.processor(text=[text], images=[Image.fromarray(media.frames[0])], return_tensors="pt")
            ids = enc["input_ids"][0]
            vision = {"pixel_values": enc["pixel_values"]}
        else:
            # the expansion ("FrameN: <img>...</img>" per frame) depends on the frame count only
            placeholder = {"pixel_values_videos": [torch.empty(len(media.frames), 0)]}
            text = text.replace(self.processor.video_token, self.processor.replace_video_token(placeholder, 0), 1)
            ids = tokenize_runs(self.tokenizer, text, self.processor.image_token)  # pad runs spliced in as ids
            vision = {"video": self.video_for_encoding(media)}  # frames resized at decode
        visual_mask = ids == self.model.config.image_token_id
        layout = self._layout(media, visual_mask) if media is not None else VisualLayout.empty()
        visual_idx = visual_mask.nonzero().flatten()
        suffix = int(visual_idx[-1]) + 1 if visual_idx.numel() else ids.shape[0]
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

    def followup_ids(self, prompt: str) -> torch.Tensor:
        text = f"<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def _tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of the processor's tile grid for an image of height x width px."""
        ip = self.processor.image_processor
        size = (ip.size["height"], ip.size["width"])
        cols, rows = compat.get_optimal_tiled_canvas((height, width), size, ip.min_patches, ip.max_patches)
        return rows, cols

    def _layout(self, media: Media, visual_mask: torch.Tensor) -> VisualLayout:
        seq_index = visual_mask.nonzero().flatten().numpy()
        width, height = media.size
        per = self.tokens_per_tile
        side = round(per**0.5)  # 16 x 16 tokens per tile
        n_units = len(seq_index) // per
        frames: list[FrameInfo] = []
        if media.kind == "video":
            frames = [
                FrameInfo("frame", (side, side), media.times[i], (i,), (0, 0, width, height)) for i in range(n_units)
            ]
        else:
            rows, cols = self._tile_grid(height, width) if n_units > 1 else (1, 1)
            for i in range(rows * cols):
                r, c = divmod(i, cols)  # the resized image is split row-major: exact tile boxes
                box = (c * width / cols, r * height / rows, (c + 1) * width / cols, (r + 1) * height / rows)
                frames.append(FrameInfo("tile", (side, side), 0.0, (0,), tuple(round(v) for v in box)))
            if n_units > rows * cols:
                frames.append(FrameInfo("global", (side, side), 0.0, (0,), (0, 0, width, height)))
        if len(frames) * per != len(seq_index):
            raise ValueError(f"layout expects {len(frames) * per} visual tokens, the processor wrote {len(seq_index)}")
        kind = "frame" if media.kind == "video" else "tile"
        units = [
            VisualUnit(kind, i, int(seq_index[i * per]), int(seq_index[i * per]) + per) for i in range(len(frames))
        ]
        frame = np.repeat(np.arange(len(frames)), per)
        row = np.tile(np.repeat(np.arange(side), side), len(frames))
        col = np.tile(np.tile(np.arange(side), side), len(frames))
        box = np.concatenate([grid_boxes(side, side, f.box) for f in frames])
        return VisualLayout(seq_index, frame, row, col, box, frames, units, (width, height), media.kind)

    # -- vision -------------------------------------------------------------------
    def _frame_pixels(self, media: Media, frames: list[int]) -> torch.Tensor:
        """(k, 3, size, size) pixel values of the given frames, through the processor (each frame on its own)."""
        chosen = np.stack([media.frames[i] for i in frames])
        return self.processor.video_processor(videos=[chosen], return_tensors="pt")["pixel_values_videos"][0]

    def video_patches_per_call(self, prepared: PreparedInput) -> int | None:
        return self._frame_unit_patches(prepared, VIDEO_FRAMES_PER_CALL)

    @torch.no_grad()
    def encode_units(self, prepared: PreparedInput, units: list[VisualUnit]) -> torch.Tensor:
        if not units:
            return torch.zeros((0, self.text_config.hidden_size), dtype=self.dtype, device=self.device)
        index = [u.frame for u in units]
        if "video" in prepared.vision_inputs:  # frames are processed only when their block runs
            media: Media = prepared.vision_inputs["video"]
            pixels = in_chunks(
                len(index), VIDEO_FRAMES_PER_CALL, lambda i0, i1: self._frame_pixels(media, index[i0:i1])
            )
        else:
            pixels = prepared.vision_inputs["pixel_values"][torch.tensor(index)]
        cfg = self.model.config
        out = self.model.model.get_image_features(
            pixel_values=pixels.to(self.device),
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        )
        return out.pooler_output.reshape(-1, out.pooler_output.shape[-1]).to(self.dtype)
