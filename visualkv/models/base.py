"""What every model family adapter provides to the engine.

An adapter owns a loaded transformers model and processor. It knows how the
processor lays visual tokens out (`VisualLayout`), how to encode a run of
visual units through the vision tower, how the LLM numbers positions, and
where the decoder layers are. The engine drives the decoder layers itself
(one loop, any block size), so adapters expose parts, not a forward.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers.image_utils import SizeDict
from transformers.video_utils import VideoMetadata

from visualkv.devices import to_device
from visualkv.errors import stop_point
from visualkv.layout import VisualLayout, VisualUnit
from visualkv.media import Media
from visualkv.models import compat


@dataclass
class PreparedInput:
    """One turn's tokens, ready for the engine.

    input_ids: (L,) token ids of the whole prompt (media placeholders expanded).
    position_ids: (P, L) the model's position ids for each token (P = 3 for
      M-RoPE, 1 for 1-D RoPE), computed once over the full, uncompressed input
      so that removed tokens never shift anyone's position.
    next_position: the position id of the first token after this input.
    visual_mask: (L,) True for visual tokens (evictable); everything else is
      protected.
    suffix_start: first index of the text after the last visual token (the
      question and the assistant prompt): the proxy/observation window.
    keep: (L,) tokens that enter the LLM at all (False: skipped frame or pruned).
    vision_inputs: adapter-specific tensors (pixel values, grids).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    next_position: int
    visual_mask: torch.Tensor
    layout: VisualLayout
    suffix_start: int
    vision_inputs: dict[str, Any] = field(default_factory=dict)
    keep: torch.Tensor | None = None
    media: Media | None = None

    def __post_init__(self) -> None:
        # per-token tables as int32 (4 + 4 x P bytes per token instead of 8 + 8 x P: an hour of video is
        # ~540k tokens); torch indexes, embeds and takes rotary angles from int32 as from int64
        self.input_ids = compact_ids(self.input_ids)
        self.position_ids = compact_ids(self.position_ids)
        if self.keep is None:
            self.keep = torch.ones_like(self.input_ids, dtype=torch.bool)

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])


def compact_ids(values: torch.Tensor) -> torch.Tensor:
    """An int64 tensor of token ids or positions as int32 where its values fit (else unchanged)."""
    if values.dtype != torch.int64 or values.numel() == 0:
        return values
    info = torch.iinfo(torch.int32)
    if int(values.min()) < info.min or int(values.max()) > info.max:
        return values
    return values.to(torch.int32)


class ModelAdapter:
    """Base class; subclasses fill in the family-specific parts."""

    family: str = ""
    default_block_size: int = 256
    #: positional axes of the LLM (3 for M-RoPE)
    position_axes: int = 1

    def __init__(self, model: torch.nn.Module, processor: Any, name: str) -> None:
        self.model = model  # the owner's: VisualKV changes it only inside `visualkv.attention.patched`
        self.processor = processor
        self.name = name
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self._ahead_units: dict[tuple[str, int], torch.Tensor] = {}  # (kind, index) -> embeddings, encoded ahead

    # -- parts of the LLM -----------------------------------------------------------
    @property
    def language_model(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.language_model.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def text_config(self):
        return self.language_model.config

    @property
    def num_kv_heads(self) -> int:
        return self.text_config.num_key_value_heads

    @property
    def query_group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.text_config.num_attention_heads // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def attn_implementation(self) -> str:
        """The decoder's attention kernel as the model names it ("sdpa", "eager", ...). While
        `visualkv.attention.patched` is entered the config names VisualKV's own functions instead, so the runtime
        asks `visualkv.attention.implementation(adapter)`."""
        return compat.attention_implementation(self.text_config) or "sdpa"

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(q,) ids -> (1, q, hidden)."""
        return self.language_model.embed_tokens(to_device(ids, self.device))[None]

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for (P, q) position ids."""
        raise NotImplementedError

    def final_hidden_to_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.language_model.norm(hidden)
        return self.model.lm_head(h.to(self.model.lm_head.weight.device)).float()

    def query_states(self, layer_idx: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE query states (1, q_heads, q, head_dim) of a layer's input.

        hidden is the decoder layer's *input* (before its input norm); cos/sin
        those of the same tokens. Mirrors the attention module's own projection.
        """
        return self._projected(layer_idx, hidden, cos, sin, "q")

    def key_states(self, layer_idx: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE key states (1, kv_heads, q, head_dim) of a layer's input (as cached)."""
        return self._projected(layer_idx, hidden, cos, sin, "k")

    def _projected(self, layer_idx: int, hidden, cos, sin, which: str) -> torch.Tensor:
        layer = self.layers[layer_idx]
        attn = layer.self_attn
        h = layer.input_layernorm(hidden)
        x = getattr(attn, f"{which}_proj")(h).view(h.shape[0], h.shape[1], -1, self.head_dim).transpose(1, 2)
        norm = getattr(attn, f"{which}_norm", None)  # Qwen3-style q/k norms, where present
        if norm is not None:
            x = norm(x)
        rope = compat.model_file_function(attn, compat.TEXT_ROPE)
        x, _ = rope(x, x, cos, sin)
        return x

    # -- media ----------------------------------------------------------------------
    def chat_text(self, media: Media | None, prompt: str) -> str:
        """The first turn as the model's chat template writes it (media placeholder + question)."""
        content: list[dict[str, Any]] = [{"type": media.kind}] if media is not None else []
        content.append({"type": "text", "text": prompt})
        return self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    def prepare(self, media: Media | None, prompt: str) -> PreparedInput:
        """Tokenize the first turn (media + prompt) with the chat template."""
        raise NotImplementedError

    def followup_ids(self, prompt: str) -> torch.Tensor:
        """Token ids that close the previous answer and open a new user turn."""
        raise NotImplementedError

    # -- video frames resized at decode ---------------------------------------------
    #: resize a lazy video's frames right after decoding them (see `video_for_encoding`); off: frames
    #: reach the processor at their decoded size (the memory benchmark's "before")
    resize_video_at_decode: bool = True

    def video_frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int] | None:
        """(height, width) the video processor resizes every frame of a `num_frames`-frame video of
        `height` x `width` px to, where `resize_with` reproduces that resize exactly (so the processor,
        given the resized frame, leaves it as is); None where unknown (frames stay at their decoded size)."""
        return None

    @staticmethod
    def resize_with(video_processor: Any, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """One (H, W, 3) uint8 frame resized to `size` (height, width) by the video processor's own resize (same
        call, same interpolation, uint8 out), so encoding it gives the same pixel values. Static: a resized lazy
        video holds it with the video processor alone, so it pickles without the model."""
        raise NotImplementedError

    def video_for_encoding(self, media: Media) -> Media:
        """The video the vision side reads frames from: a lazy video's frames resized at decode to what the
        processor needs (`Media.resized_at_decode`), so a block holds small frames; `media` itself where the
        family gives no size, the frames would not shrink, or the video is eager. The layout and the report
        keep using `media` (boxes in decoded pixels)."""
        if not self.resize_video_at_decode or media.kind != "video" or not media.is_lazy:
            return media
        width, height = media.size
        size = self.video_frame_size(height, width, media.num_frames)
        if size is None:
            return media
        return media.resized_at_decode(size, partial(type(self).resize_with, self.processor.video_processor, size=size))

    def encode_units(self, prepared: PreparedInput, units: list[VisualUnit]) -> torch.Tensor:
        """Visual embeddings (n, hidden) for consecutive units, in sequence order."""
        raise NotImplementedError

    def encode_units_with_layer_features(
        self, prepared: PreparedInput, units: list[VisualUnit]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embeddings (n, hidden) plus, per early decoder layer k, features (n, hidden) that the model
        adds to these tokens' hidden states after layer k (Qwen3-VL's DeepStack); none for most families.
        Units encoded ahead (`encode_ahead`) are taken from there."""
        held = self._ahead_units
        if held and units and all((u.kind, u.frame) in held for u in units):
            return torch.cat([held.pop((u.kind, u.frame)) for u in units]), []
        for u in units:
            held.pop((u.kind, u.frame), None)
        return self.encode_units(prepared, units), []

    @property
    def patches_per_token(self) -> int:
        """Vision-tower inputs (patches) behind one visual token: the spatial merge (Qwen: 2x2) or the pixel
        shuffle (SmolVLM: `scale_factor`^2) that packs several patches into a token; 1 where none does."""
        config = self.model.config
        vision = getattr(config, "vision_config", None)
        merge = getattr(vision, "spatial_merge_size", None)
        return int(merge) ** 2 if merge else int(getattr(config, "scale_factor", None) or 1) ** 2

    def vision_call_patches(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Patches in the largest single vision-tower call that encoding `groups` makes: one group is a
        block's own call, several are blocks encoded ahead in one call (`encode_ahead`). An upper bound
        (what a buffer already holds is counted again): the memory guard's vision term.
        This default: every unit's tokens, times `patches_per_token`, in one call."""
        return sum(u.seq_end - u.seq_start for group in groups for u in group) * self.patches_per_token

    def vision_output_tokens(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Tokens of vision-tower output held at once while `groups` are encoded (as `vision_call_patches`): the
        memory guard's output term. This default: the largest call's patches packed into tokens."""
        return self.vision_call_patches(prepared, groups) // self.patches_per_token

    def vision_cut_tokens(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Tokens of vision features held at once after the call, while the block's tokens are cut from its
        output (the tower's activations freed by then): the memory guard's second vision phase. This default:
        none beyond the output itself."""
        return 0

    def vision_held_tokens(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> int:
        """Tokens of vision features still buffered once `groups` are encoded, while the LLM runs their block
        (kept for a later block that reads them again): the memory guard adds them to the LLM's phase. This
        default: none."""
        return 0

    def vision_input_copies_for(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> float:
        """`vision_input_copies` for the call encoding `groups`; an adapter whose call reads a view of the
        prepared input, already on the device in the model's dtype, allocates no copy of it."""
        return self.vision_input_copies

    #: float32 copies of a vision call's pixel input alive at once (the processor's output, index and contiguous
    #: copies, per-pixel masks), in units of the call's pixel values: at the peak of their preparation, and
    #: still held while the tower runs. The memory guard's input terms, measured on CPU per family on the tiny
    #: models (their small towers make them show); on a GPU host-side copies do not count (an upper bound).
    vision_prep_copies: float = 1.0
    vision_input_copies: float = 1.0
    #: the same while a video's frames go through the family's video processor (measured alike, on
    #: assets/example_video.webm: its float32 intermediates of every frame it is given)
    vision_video_prep_copies: float = 1.0

    def vision_prep_copies_for(self, prepared: PreparedInput, patches: int) -> float:
        """`vision_prep_copies` for a call of `patches` patches on `prepared`. A video: the processor's copies
        of what it is given at once (`video_patches_per_call`), plus the buffer the chunks fill."""
        if "video" not in prepared.vision_inputs:
            return self.vision_prep_copies
        chunk = self.video_patches_per_call(prepared)
        copies = self.vision_video_prep_copies
        return copies if chunk is None or patches <= chunk else 1 + copies * chunk / patches

    def video_patches_per_call(self, prepared: PreparedInput) -> int | None:
        """Patches the video processor is given at most at once (`in_chunks`); None: a block's frames together."""
        return None

    def _frame_unit_patches(self, prepared: PreparedInput, frames: int) -> int:
        """Patches of `frames` video frames where every frame is a unit of its own tokens (SmolVLM2, InternVL)."""
        unit = prepared.layout.units[0]
        return frames * (unit.seq_end - unit.seq_start) * self.patches_per_token

    #: each unit (a tile, a frame) is encoded as an image of its own: its embeddings do not depend on the units
    #: sharing its tower call, so the default `encode_ahead` may put several blocks' units in one call
    units_independent = False

    def encodes_ahead(self, prepared: PreparedInput) -> bool:
        """Whether `encode_ahead` encodes several blocks' media of `prepared` in one call (else it does nothing)."""
        return self.units_independent

    def encode_ahead(self, prepared: PreparedInput, groups: list[list[VisualUnit]]) -> None:
        """A hint before the first of several blocks: `groups` are their kept units, in order. An adapter that
        can encode them in one vision-tower call, with each group's results what `encode_units` on that group
        alone returns, does so now and holds the results for those calls (freed as they are read, and by
        `reset_stream`). This default does it for independent units (one `encode_units` call over all of them,
        split per unit); otherwise it encodes block by block: nothing to do here."""
        if not self.encodes_ahead(prepared):
            return
        units = [u for group in groups for u in group if (u.kind, u.frame) not in self._ahead_units]
        if len(units) < 2:
            return
        out = self.encode_units(prepared, units)
        self._ahead_units.update(
            zip([(u.kind, u.frame) for u in units], out.split([u.seq_end - u.seq_start for u in units]))
        )

    def reset_stream(self) -> None:
        """Forget any vision strip buffered between blocks (and anything encoded ahead)."""
        self._ahead_units = {}

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        for cfg in (getattr(self.model, "generation_config", None), self.model.config, self.text_config):
            eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def describe(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "model_type": self.model.config.model_type,
            "name": self.name,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).replace("torch.", ""),
            "attn_implementation": self.attn_implementation,
        }


@dataclass
class LayerFeatures:
    """Additive per-layer features for some tokens of a block (DeepStack-style vision injection).

    token_index: (n,) sequence indices (the engine's `token_index` numbering) of the tokens they belong to.
    features: one (n, hidden) tensor per decoder layer k = 0, 1, ...: added to those tokens' hidden
      states right after layer k, as the family's own forward does.
    """

    token_index: torch.Tensor
    features: list[torch.Tensor]

    def add_after_layer(self, layer_idx: int, hidden: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """hidden (1, q, d) of tokens `token_index` (q,), sorted) with layer `layer_idx`'s features added.

        Tokens no longer in the block (merged away by a method in an earlier layer) get nothing; their
        features are masked, not filtered, so no host synchronisation happens.
        """
        if layer_idx >= len(self.features):
            return hidden
        device = hidden.device
        present_index = to_device(token_index, device)
        mine = to_device(self.token_index, device)
        where = torch.searchsorted(present_index, mine).clamp_(max=present_index.numel() - 1)
        present = present_index[where] == mine
        add = self.features[layer_idx].to(device, hidden.dtype) * present[:, None].to(hidden.dtype)
        return hidden.index_add(1, where, add[None])  # out of place, like transformers' own injection


#: frames per call to a video processor while a block's frames are encoded (`in_chunks`): it holds several
#: float32 copies of what it is given, and a bulk prefill gave it every frame of the video at once
VIDEO_FRAMES_PER_CALL = 8


def in_chunks(n: int, chunk: int, process: Callable[[int, int], torch.Tensor], dim: int = 0) -> torch.Tensor:
    """`process(i0, i1)` over [0, n) at most `chunk` at a time, written into one tensor along `dim`: the same
    result as `process(0, n)` where every item is processed on its own (a video processor's frames), with the
    processor's intermediates of one chunk instead of all."""
    if n <= chunk:
        return process(0, n)
    out = None
    for i0 in range(0, n, chunk):
        stop_point()  # a prefill's Stop ends a long video's preparation between chunks
        i1 = min(i0 + chunk, n)
        part = process(i0, i1)
        if out is None:
            per_item = part.shape[dim] // (i1 - i0)
            shape = list(part.shape)
            shape[dim] = per_item * n
            out = part.new_empty(shape)
        out.narrow(dim, i0 * per_item, (i1 - i0) * per_item).copy_(part)
    return out


def video_metadata(media: Media) -> VideoMetadata:
    """Metadata telling a video processor our frames are already sampled (at their real times)."""
    n = len(media.frames)
    span = media.times[-1] - media.times[0] if n > 1 else 0.0
    fps = (n - 1) / span if span > 0 else 1.0
    w, h = media.size  # from metadata: a lazy video decodes nothing here
    return VideoMetadata(
        total_num_frames=n, fps=fps, width=w, height=h, duration=media.duration or 0.0, frames_indices=list(range(n))
    )


def splice_runs(tokenizer: Any, text: str, token: str, lengths: Sequence[int]) -> torch.Tensor:
    """(L,) ids of `text` with its k-th `token` (a special token, written once) repeated lengths[k] times:
    the ids `tokenizer` gives for the expanded text, without building or tokenizing that text (an hour of
    video is ~540k pad tokens on Qwen2.5-VL). A special token is never merged with its neighbours, so
    tokenizing each run as one token changes nothing else; tests/test_lazy_video.py checks it."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    token_id = tokenizer.convert_tokens_to_ids(token)
    where = (ids == token_id).nonzero().flatten()
    if where.numel() != len(lengths):  # not atomic in this tokenizer: tokenize the expansion itself
        parts = text.split(token)
        expanded = parts[0] + "".join(token * n + rest for n, rest in zip(lengths, parts[1:], strict=True))
        return tokenizer(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    repeats = torch.ones_like(ids)
    repeats[where] = torch.as_tensor(list(lengths), dtype=ids.dtype)
    return ids.repeat_interleave(repeats)


def tokenize_runs(tokenizer: Any, text: str, token: str) -> torch.Tensor:
    """(L,) ids of `text` (an expansion written by a processor, with long runs of the special `token`),
    tokenized with each run collapsed to one token and spliced back (see `splice_runs`)."""
    pattern = re.compile(f"(?:{re.escape(token)})+")
    lengths = [(m.end() - m.start()) // len(token) for m in pattern.finditer(text)]
    return splice_runs(tokenizer, pattern.sub(token, text), token, lengths)


def text_positions(start: int, n: int, axes: int) -> torch.Tensor:
    """(axes, n) position ids for plain text starting at `start`."""
    return (torch.arange(n) + start).view(1, n).expand(axes, n).clone()


def frame_as_video(frame: np.ndarray) -> torch.Tensor:
    """(1, 1, 3, H, W) uint8 tensor of one (H, W, 3) frame: the layout a video processor resizes (one video of
    one frame, channels first), so its resize runs the same kernel as on a block's frames."""
    return torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).contiguous()[None, None]


def video_as_frame(video: torch.Tensor) -> np.ndarray:
    """(H, W, 3) uint8 array of a (1, 1, 3, H, W) tensor (inverse of `frame_as_video`)."""
    return np.ascontiguousarray(video[0, 0].permute(1, 2, 0).numpy())


def processor_size(processor: Any) -> SizeDict:
    """A video or image processor's `size` as the SizeDict its own calls see."""
    size = processor.size
    return size if isinstance(size, SizeDict) else SizeDict(**dict(size))


def fixed_video_frame_size(video_processor: Any) -> tuple[int, int] | None:
    """(height, width) of a video processor that resizes every frame to one fixed size (one tile: LLaVA-OneVision,
    InternVL), or None when it does not resize."""
    size = processor_size(video_processor)
    return (size.height, size.width) if video_processor.do_resize and size.height and size.width else None


def resize_like_processor(video_processor: Any, frame: np.ndarray, **kwargs: Any) -> np.ndarray:
    """One (H, W, 3) uint8 frame through the video processor's own `resize`, with the size and resample its
    call uses by default (plus `kwargs`, the family's extra arguments): uint8 in and out."""
    vp = video_processor
    out = vp.resize(frame_as_video(frame), size=processor_size(vp), resample=vp.resample, **kwargs)
    return video_as_frame(out)
