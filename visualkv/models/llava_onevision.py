"""LLaVA-OneVision adapter (`LlavaOnevisionForConditionalGeneration`, the llava-hf checkpoints).

An image is the base tile (729 tokens) then the anyres map written row by row, each row with its newline token;
the map's rows run across every tile of a tile row, so the units are the base tile and the map's rows. A block
encodes only the tile rows its map rows come from, and the anyres downsampling is applied with the interpolation
kernel's own weights restricted to the block's rows, so streaming is exact. A video frame is one pooled tile
(196 tokens), its own unit. Positions are 1-D. Details: docs/METHODS.md#model-families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.image_processing_utils import select_best_resolution

from visualkv.devices import to_device
from visualkv.layout import FrameInfo, VisualLayout, VisualUnit, consecutive_runs, grid_boxes
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


@dataclass(frozen=True)
class AnyresGeometry:
    """Where the packed anyres feature map of one image comes from (all in feature cells).

    tile: features per tile side (27); tile_rows/tile_cols: the 384-px tile grid; crop_top/crop_left,
    crop_h/crop_w: the unpadded region of the joined (tile_rows*tile) x (tile_cols*tile) map;
    rows/cols: the packed map after the anyres_max downsampling (== crop size when none).
    """

    tile: int
    tile_rows: int
    tile_cols: int
    crop_top: int
    crop_left: int
    crop_h: int
    crop_w: int
    rows: int
    cols: int

    @property
    def downsampled(self) -> bool:
        return (self.rows, self.cols) != (self.crop_h, self.crop_w)


def anyres_geometry(
    height: int, width: int, pinpoints: list, tile_px: int, tile: int, max_tiles: int
) -> AnyresGeometry:
    """The packed map of an image of `height` x `width` px, mirroring the model's `pack_image_features`."""
    best_h, best_w = select_best_resolution((height, width), pinpoints)
    tile_rows, tile_cols = best_h // tile_px, best_w // tile_px
    full_h, full_w = tile_rows * tile, tile_cols * tile
    top = left = 0
    crop_h, crop_w = full_h, full_w
    if width / height > full_w / full_h:  # unpad_image: padding above and below
        new_h = int(round(height * (full_w / width), 7))
        top = (full_h - new_h) // 2
        crop_h = full_h - 2 * top
    else:  # padding left and right
        new_w = int(round(width * (full_h / height), 7))
        left = (full_w - new_w) // 2
        crop_w = full_w - 2 * left
    ratio = math.sqrt(crop_h * crop_w / (max_tiles * tile**2))
    rows, cols = (int(crop_h // ratio), int(crop_w // ratio)) if ratio > 1.1 else (crop_h, crop_w)
    return AnyresGeometry(tile, tile_rows, tile_cols, top, left, crop_h, crop_w, rows, cols)


def _interp_weights(n_out: int, n_in: int, like: torch.Tensor) -> torch.Tensor:
    """(n_out, n_in) weights of 1-D bilinear resampling, exactly as F.interpolate computes them."""
    eye = torch.eye(n_in, dtype=like.dtype, device=like.device)[None, None]  # (1, 1, n_in, n_in)
    # resample the rows only (columns keep their size, so they map onto themselves with weight 1)
    return F.interpolate(eye, size=(n_out, n_in), mode="bilinear")[0, 0]


class LlavaOnevisionAdapter(ModelAdapter):
    family = "llava_onevision"
    default_block_size = 729  # one 384-px tile's worth of tokens: the base image is a block of its own
    position_axes = 1
    vision_video_prep_copies = 3.0  # its video processor on a block's frames: 2.5 measured

    def __init__(self, model, processor, name: str) -> None:
        super().__init__(model, processor, name)
        vcfg = model.config.vision_config
        self.tile = vcfg.image_size // vcfg.patch_size  # 27 features per tile side
        self.max_tiles = int(model.config.vision_aspect_ratio.replace("anyres_max_", ""))
        self._tile_rows: dict[int, torch.Tensor] = {}  # tile row -> (tile, tile_cols*tile, d) features
        self._ahead_base: torch.Tensor | None = None  # the base image's features, encoded ahead with tile rows

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    def rotary(self, hidden, positions):
        return compat.rotary_tables(self.language_model, hidden, to_device(positions[:1], hidden.device))

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
            height, width = media.frames[0].shape[:2]
            ip = self.processor.image_processor
            tile_px = self.model.config.vision_config.image_size  # 384: the processor's tile size
            geometry = anyres_geometry(
                height, width, [list(p) for p in ip.image_grid_pinpoints], tile_px, self.tile, self.max_tiles
            )
            vision = {"pixel_values": enc["pixel_values"][0], "geometry": geometry}
        else:
            # the video expansion depends on the frame count only: no pixel is processed here
            placeholder = {"pixel_values_videos": [[None] * len(media.frames)]}
            text = text.replace(self.processor.video_token, self.processor.replace_video_token(placeholder, 0), 1)
            ids = tokenize_runs(self.tokenizer, text, self.processor.video_token)  # pad runs spliced in as ids
            vision = {"video": self.video_for_encoding(media)}  # frames resized at decode
        cfg = self.model.config
        visual_mask = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
        layout = self._layout(media, visual_mask, vision) if media is not None else VisualLayout.empty()
        visual_idx = visual_mask.nonzero().flatten()
        suffix = int(visual_idx[-1]) + 1 if visual_idx.numel() else ids.shape[0]
        self.reset_stream()
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
        text = f"<|im_end|><|im_start|>user \n{prompt}<|im_end|><|im_start|>assistant\n"
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def _layout(self, media: Media, visual_mask: torch.Tensor, vision: dict) -> VisualLayout:
        seq_index = visual_mask.nonzero().flatten().numpy()
        width, height = media.size
        whole = (0, 0, width, height)
        frames: list[FrameInfo] = []
        units: list[VisualUnit] = []
        frame, row, col, box, newline = [], [], [], [], []

        def grid(f: int, rows: int, cols: int, start: int, kind: str, with_newline: bool, time: float = 0.0):
            """One grid of tokens (row-major) at sequence position `start`; returns tokens written."""
            boxes = grid_boxes(rows, cols, whole)
            per_row = cols + int(with_newline)
            for r in range(rows):
                s = int(seq_index[start + r * per_row])
                if kind == "rows":
                    units.append(VisualUnit("rows", f, s, s + per_row, row=r))
                cells = list(range(cols)) + ([cols - 1] if with_newline else [])  # newline: at its row's end
                frame.extend([f] * per_row)
                row.extend([r] * per_row)
                col.extend(cells)
                box.append(boxes[r * cols + np.array(cells)])
                newline.extend([False] * cols + [True] * int(with_newline))
            return rows * per_row

        if media.kind == "image":
            g: AnyresGeometry = vision["geometry"]
            frames.append(FrameInfo("global", (self.tile, self.tile), 0.0, (0,), whole))
            units.append(VisualUnit("tile", 0, int(seq_index[0]), int(seq_index[0]) + self.tile**2))
            n = grid(0, self.tile, self.tile, 0, "tile", False)
            frames.append(FrameInfo("image", (g.rows, g.cols), 0.0, (0,), whole))
            n += grid(1, g.rows, g.cols, n, "rows", True)
        else:
            side = math.ceil(self.tile / 2)  # 2x2 bilinear pooling: 27 -> 14
            n = 0
            for f in range(len(media.frames)):
                frames.append(FrameInfo("frame", (side, side), media.times[f], (f,), whole))
                s = int(seq_index[n])
                n += grid(f, side, side, n, "frame", False)
                units.append(VisualUnit("frame", f, s, s + side * side))
            # the single newline after the last frame belongs to the last frame's unit
            frame.append(len(media.frames) - 1)
            row.append(side - 1)
            col.append(side - 1)
            box.append(box[-1][-1:])
            newline.append(True)
            units[-1].seq_end += 1
            n += 1
        if n != len(seq_index):
            raise ValueError(f"layout expects {n} visual tokens, the processor wrote {len(seq_index)}")
        return VisualLayout(
            seq_index,
            np.array(frame),
            np.array(row),
            np.array(col),
            np.concatenate(box),
            frames,
            units,
            (width, height),
            media.kind,
            extra={"newline": np.array(newline)},
        )

    # -- vision -------------------------------------------------------------------
    def reset_stream(self) -> None:
        super().reset_stream()
        self._tile_rows = {}
        self._ahead_base = None

    def encodes_ahead(self, prepared: PreparedInput) -> bool:
        # video: frames pooled one by one (the base class batches them); image: tile rows (and the base image)
        return True

    @torch.no_grad()
    def encode_ahead(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> None:
        """Video as the base class does it. Image: the tile rows every map row of these blocks reads, and the
        base image if a block holds it, in one tower call; each tile is an image of its own there, as in a call
        per block. They wait in the tile-row buffer that `_crop_rows` reads and empties as blocks move down."""
        vision = prepared.vision_inputs
        if "video" in vision:
            super().encode_ahead(prepared, groups)
            return
        g: AnyresGeometry = vision["geometry"]
        units = [u for group in groups for u in group]
        missing = sorted(self._tile_rows_read(g, units) - self._tile_rows.keys())
        base = self._ahead_base is None and any(u.kind == "tile" for u in units)
        if len(missing) + base < 2:
            return  # one tile row or the base image alone: what a block's own call encodes
        index = [0] * base + [1 + r * g.tile_cols + c for r in missing for c in range(g.tile_cols)]
        feats = self._tiles(vision["pixel_values"][index])  # (k, t, t, d); pixel tile 0 is the base image
        if base:
            self._ahead_base, feats = feats[0].flatten(0, 1), feats[1:]
        for i, r in enumerate(missing):
            row = feats[i * g.tile_cols : (i + 1) * g.tile_cols]
            self._tile_rows[r] = row.permute(1, 0, 2, 3).reshape(self.tile, g.tile_cols * self.tile, -1)

    def _tile_rows_read(self, g: AnyresGeometry, units: list[VisualUnit]) -> set[int]:
        """The tile rows the map rows among `units` read."""
        needed: set[int] = set()
        rows = sorted({u.row for u in units if u.kind != "tile"})
        for r0, r1 in consecutive_runs(rows):  # runs of rows read the same source rows as a block's runs do
            s0, s1, _ = self._source_rows(g, r0, r1)
            needed.update(range((g.crop_top + s0) // self.tile, (g.crop_top + s1 - 1) // self.tile + 1))
        return needed

    def vision_call_patches(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Every tower input is a 384-px tile of tile x tile patches. Video: one call for the blocks' frames.
        Image: a block's own encoding calls the tower once per tile row it reads (`_tile_row`) and once for the
        base image; blocks encoded ahead (several groups, `encode_ahead`) send them all in one call."""
        per_tile = self.tile**2
        if "video" in prepared.vision_inputs:
            return sum(len(group) for group in groups) * per_tile  # one unit per frame
        cols, base, rows = self._tiles_read(prepared, groups)
        if len(groups) > 1:
            return (base + rows * cols) * per_tile
        return (cols if rows else int(base)) * per_tile

    def _tiles_read(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> tuple[int, bool, int]:
        """An image's tiles per row, whether `groups` hold the base image, and how many tile rows they read."""
        g: AnyresGeometry = prepared.vision_inputs["geometry"]
        units = [u for group in groups for u in group]
        return g.tile_cols, any(u.kind == "tile" for u in units), len(self._tile_rows_read(g, units))

    #: copies of the tile rows' features a block's image encoding holds at once after its tower call: the
    #: tile-row buffer, `_crop_rows` joining the rows a block reads, and the map rows cut from them
    TILE_ROW_FEATURE_COPIES = 3

    def vision_output_tokens(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Image: the features of every tile row the blocks read (the buffer, the call's new rows included) and
        the base image's, alive with the call's last activations. Video: the call's own output."""
        if "video" in prepared.vision_inputs:
            return super().vision_output_tokens(prepared, groups)
        cols, base, rows = self._tiles_read(prepared, groups)
        return (base + rows * cols) * self.tile**2

    def vision_cut_tokens(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Image, a block's own call: its rows' `TILE_ROW_FEATURE_COPIES` copies while its map rows are cut
        (blocks encoded ahead cut theirs later, one block at a time)."""
        if "video" in prepared.vision_inputs or len(groups) > 1:
            return 0
        cols, base, rows = self._tiles_read(prepared, groups)
        return (base + self.TILE_ROW_FEATURE_COPIES * rows * cols) * self.tile**2

    def vision_held_tokens(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Image: the tile rows a block read stay buffered until a block below them (`_crop_rows`)."""
        if "video" in prepared.vision_inputs:
            return 0
        cols, _, rows = self._tiles_read(prepared, groups)
        return rows * cols * self.tile**2

    def vision_prep_copies_for(self, prepared: PreparedInput, patches: int) -> float:
        """Image: the tiles' pixels were prepared with the input (`prepare`); a call prepares none."""
        return super().vision_prep_copies_for(prepared, patches) if "video" in prepared.vision_inputs else 0.0

    def vision_input_copies_for(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> float:
        """Image, a block's own call: a slice of the prepared tiles (`_tile_row`), a view where they are already
        on the device in the model's dtype; blocks encoded ahead index theirs (a copy)."""
        pixels = prepared.vision_inputs.get("pixel_values")
        view = (
            "video" not in prepared.vision_inputs
            and len(groups) == 1
            and pixels is not None
            and pixels.device == self.device
            and pixels.dtype == self.model.dtype
        )
        return 0.0 if view else super().vision_input_copies_for(prepared, groups)

    @torch.no_grad()
    def encode_units(self, prepared: PreparedInput, units: list[VisualUnit]) -> torch.Tensor:
        if not units:
            return torch.zeros((0, self.text_config.hidden_size), dtype=self.dtype, device=self.device)
        vision = prepared.vision_inputs
        if "video" in vision:
            return self._encode_frames(vision["video"], [u.frame for u in units])
        parts, rows = [], []
        for unit in units:
            if unit.kind == "tile":  # the base image
                base, self._ahead_base = self._ahead_base, None
                parts.append(base if base is not None else self._tiles(vision["pixel_values"][:1])[0].flatten(0, 1))
            else:
                rows.append(unit.row)
        # consecutive runs of map rows (rows whose every token was pruned are absent)
        parts += [self._encode_rows(vision, r0, r1) for r0, r1 in consecutive_runs(rows)]
        return torch.cat(parts).to(self.dtype)

    def _tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """(k, tile, tile, d) features of k 384-px tiles, through the model's own image path.

        Passing the tiles as the images of a multi-image sample (`batch_num_images` > 1, which is what
        turns the anyres split off, even for one tile) makes `get_image_features` skip the anyres
        packing: each tile comes back as its tile x tile features plus a newline, dropped here.
        """
        k = pixels.shape[0]
        out = self.model.model.get_image_features(
            pixel_values=pixels.to(self.device, self.model.dtype),
            image_sizes=torch.tensor([[pixels.shape[-2], pixels.shape[-1]]] * k),
            batch_num_images=torch.tensor([max(k, 2)]),
        )
        return torch.stack([f[:-1] for f in out.pooler_output]).view(k, self.tile, self.tile, -1)

    def _tile_row(self, vision: dict, tile_row: int) -> torch.Tensor:
        """(tile, tile_cols*tile, d) joined features of one row of tiles (buffered)."""
        if tile_row not in self._tile_rows:
            g: AnyresGeometry = vision["geometry"]
            first = 1 + tile_row * g.tile_cols  # pixel tile 0 is the base image
            feats = self._tiles(vision["pixel_values"][first : first + g.tile_cols])  # (cols, t, t, d)
            self._tile_rows[tile_row] = feats.permute(1, 0, 2, 3).reshape(self.tile, g.tile_cols * self.tile, -1)
        return self._tile_rows[tile_row]

    def _crop_rows(self, vision: dict, s0: int, s1: int) -> torch.Tensor:
        """(s1 - s0, crop_w, d) rows [s0, s1) of the unpadded map; frees tile rows above s0."""
        g: AnyresGeometry = vision["geometry"]
        first, last = (g.crop_top + s0) // self.tile, (g.crop_top + s1 - 1) // self.tile
        for old in [r for r in self._tile_rows if r < first]:
            del self._tile_rows[old]  # blocks move down the image: earlier tile rows are done
        joined = torch.cat([self._tile_row(vision, r) for r in range(first, last + 1)])
        top = g.crop_top + s0 - first * self.tile
        return joined[top : top + s1 - s0, g.crop_left : g.crop_left + g.crop_w]

    def _source_rows(self, g: AnyresGeometry, r0: int, r1: int) -> tuple[int, int, torch.Tensor | None]:
        """The rows [s0, s1) of the unpadded map that packed rows [r0, r1) read, and their (r1 - r0, crop_h)
        downsampling weights (None where the map is not downsampled: row r is source row r)."""
        if not g.downsampled:
            return r0, r1, None
        w_rows = _interp_weights(g.rows, g.crop_h, self.model.model.image_newline)[r0:r1]  # (r, crop_h)
        used = w_rows.abs().sum(0).nonzero().flatten()  # host sync (vision side, once per block): which tile rows
        return int(used[0]), int(used[-1]) + 1, w_rows

    def _encode_rows(self, vision: dict, r0: int, r1: int) -> torch.Tensor:
        """((r1 - r0) * (cols + 1), d): packed map rows [r0, r1), each followed by the newline token."""
        g: AnyresGeometry = vision["geometry"]
        if g.downsampled:
            probe = self.model.model.image_newline
            s0, s1, w_rows = self._source_rows(g, r0, r1)
            source = self._crop_rows(vision, s0, s1)  # (s1 - s0, crop_w, d)
            w_cols = _interp_weights(g.cols, g.crop_w, probe)  # (cols, crop_w)
            feats = torch.einsum("rs,scd,wc->rwd", w_rows[:, s0:s1].to(source.dtype), source, w_cols.to(source.dtype))
        else:
            feats = self._crop_rows(vision, r0, r1)
        newline = self.model.model.image_newline.to(feats.device, feats.dtype)
        feats = torch.cat([feats, newline.expand(feats.shape[0], 1, -1)], dim=1)
        return feats.flatten(0, 1)

    def _frame_pixels(self, media: Media, frames: list[int]) -> torch.Tensor:
        """(1, k, 3, 384, 384) pixel values of the given frames, through the processor (each frame on its own)."""
        chosen = np.stack([media.frames[i] for i in frames])
        return self.processor.video_processor(videos=[chosen], return_tensors="pt")["pixel_values_videos"]

    def video_patches_per_call(self, prepared: PreparedInput) -> int | None:
        return VIDEO_FRAMES_PER_CALL * self.tile**2

    def _encode_frames(self, media: Media, frames: list[int]) -> torch.Tensor:
        """(196 per frame (+1 newline if the last frame is asked), d), frames processed here."""
        pixels = in_chunks(
            len(frames), VIDEO_FRAMES_PER_CALL, lambda i0, i1: self._frame_pixels(media, frames[i0:i1]), 1
        )
        out = self.model.model.get_video_features(pixel_values_videos=pixels.to(self.device, self.model.dtype))
        feats = out.pooler_output[0]  # (k * 196 + 1, d): the model appends one newline
        if frames[-1] != len(media.frames) - 1:
            feats = feats[:-1]
        return feats.to(self.dtype)
