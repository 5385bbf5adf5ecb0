"""VisualKV leaves the user's model exactly as it found it.

On every family's tiny model: the model's state (every config's attributes, every module's own attributes, hook
dicts included, and its parameters' identities and versions) and transformers' own `model(...)` logits and
`generate` tokens are recorded, then every method and composition runs chat turns (image then a follow-up, a
video, both decoders, a reprefill), a turn stopped mid-prefill, turns that fail in the prefill and in decoding,
and an answer abandoned mid-stream; the state must be identical and the stock outputs bit-identical.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import GenerationConfig, PretrainedConfig

from tests.conftest import get_adapter
from visualkv.attention import implementation, patched
from visualkv.attention.patch import _PATCHES
from visualkv.bench.synthetic import image_media, video_media
from visualkv.errors import PrefillStopped
from visualkv.methods import method_names, method_traits
from visualkv.models.base import video_metadata
from visualkv.runtime.session import ChatSession, SessionConfig

FAMILIES = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-smolvlm2", "tiny-internvl3.5", "tiny-llava-onevision"]
PROMPT = "What is in the picture?"
_STRUCTURE = ("_parameters", "_buffers", "_modules")  # a module's own tensors and children: recorded apart


def _plain(value: Any) -> Any:
    """A comparable record of an attribute's value: plain data as it is, containers element-wise, any other object
    (a function, a config, a tensor) by identity."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):  # hook dicts are OrderedDicts of handles -> functions
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return (type(value).__name__, [_plain(item) for item in value])
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    return (type(value).__name__, id(value))


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every config object the model and its modules hold, with their sub-configs, once each."""
    found: dict[int, Any] = {}
    stack = [model.config, model.generation_config, *(getattr(m, "config", None) for m in model.modules())]
    while stack:
        config = stack.pop()
        if not isinstance(config, (PretrainedConfig, GenerationConfig)) or id(config) in found:
            continue
        found[id(config)] = config
        stack.extend(vars(config).values())
    return list(found.values())


def model_state(model: torch.nn.Module) -> dict:
    """What VisualKV could change in a model: configs' attributes, modules' own attributes (a `forward` override,
    hooks, `training`), which tensors a module holds, and every parameter's and buffer's in-place version."""
    configs = {id(c): (type(c).__name__, _plain(vars(c))) for c in _configs(model)}
    modules = {}
    for name, module in model.named_modules():
        own = {key: _plain(value) for key, value in vars(module).items() if key not in _STRUCTURE}
        own["tensors"] = {
            kind: {key: _plain(t) for key, t in getattr(module, kind).items()} for kind in ("_parameters", "_buffers")
        }
        own["children"] = list(module._modules)
        modules[name] = own
    return {"configs": configs, "modules": modules}


def _stock_outputs(adapter, media) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own forward logits and greedy `generate` tokens on `media` and a fixed prompt."""
    proc = adapter.processor
    text = adapter.chat_text(media, PROMPT)
    if media.kind == "image":
        pil = Image.fromarray(media.frames[0])
        enc = proc(text=[text], images=[[pil]] if adapter.family == "smolvlm" else [pil], return_tensors="pt")
    else:
        enc = proc(
            text=[text],
            videos=[torch.from_numpy(np.stack(media.frames))],
            video_metadata=[video_metadata(media)],
            do_sample_frames=False,
            return_tensors="pt",
        )
    with torch.no_grad():
        logits = adapter.model(**enc).logits
        tokens = adapter.model.generate(**enc, max_new_tokens=4, do_sample=False)
    return logits, tokens


def _config(method: str, index: int, **overrides) -> SessionConfig:
    """Small turns; the fixed-shape and the plain decoder alternate, and so do the decoder's attentions."""
    settings: dict[str, Any] = {
        "method": method,
        "budget": 16 if method_traits(method).needs_budget else None,
        "max_new_tokens": 2,
        "decode": ("static", "eager")[index % 2],
        "decode_attention": ("grouped", "model")[index // 2 % 2],
    }
    return SessionConfig(**(settings | overrides))


#: methods that also run a video turn and a follow-up that rebuilds the cache with its question
VIDEO_METHODS = ("salicache", "blockwise-snapkv+lightkv+salicache")


def _every_method(adapter, image, video) -> None:
    for index, method in enumerate(method_names()):
        session = ChatSession(adapter, _config(method, index))
        session.ask("What is this?", image)
        session.ask("And the colours?")
    for index, method in enumerate(VIDEO_METHODS):
        session = ChatSession(adapter, _config(method, index, followup="reprefill"))
        session.ask("What moves?", video)
        session.ask("Where to?")


def _stopped_and_failed(adapter, image, state: dict) -> None:
    """A turn stopped mid-prefill, turns failing in the prefill and in decoding, an abandoned answer: after each
    the model is as it was (the abandoned generator checked while it is still suspended)."""
    config = _config("blockwise-snapkv", 0, prefill="blockwise", block_size=16, max_new_tokens=6)
    stop = threading.Event()
    with pytest.raises(PrefillStopped):
        list(ChatSession(adapter, config).stream("What?", image, on_block=lambda event: stop.set(), stop=stop))
    assert model_state(adapter.model) == state

    def fail(event):
        raise RuntimeError("a block callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        ChatSession(adapter, config).ask("What?", image, on_block=fail)
    assert model_state(adapter.model) == state

    session = ChatSession(adapter, config)
    sampled = []

    def sample_then_fail(logits, generator, sample=session._sample):
        if len(sampled) == 2:
            raise RuntimeError("sampling failed")
        sampled.append(1)
        return sample(logits, generator)

    session._sample = sample_then_fail
    with pytest.raises(RuntimeError, match="sampling failed"):
        session.ask("What?", image)
    assert model_state(adapter.model) == state

    session = ChatSession(adapter, _config("full", 0, max_new_tokens=40))  # the fixed-shape decoder
    letter = adapter.tokenizer("a", add_special_tokens=False)["input_ids"][0]
    session._sample = lambda logits, generator: letter  # every token a visible piece: the stream yields at once
    answer = session.stream("What?", image)
    assert next(answer) and next(answer)  # two steps decoded; then the consumer stops iterating, holding it
    assert model_state(adapter.model) == state
    answer.close()


@pytest.mark.parametrize("alias", FAMILIES)
def test_sessions_leave_the_model_exactly_as_they_found_it(alias):
    adapter = get_adapter(alias)
    image, video = image_media(224, 168, seed=1), video_media(4, 224, 168, fps=1.0, seed=3)
    stock_logits, stock_tokens = _stock_outputs(adapter, image)
    state = model_state(adapter.model)
    _every_method(adapter, image, video)
    assert model_state(adapter.model) == state
    _stopped_and_failed(adapter, image, state)
    assert model_state(adapter.model) == state
    logits, tokens = _stock_outputs(adapter, image)
    assert torch.equal(logits, stock_logits) and torch.equal(tokens, stock_tokens)


def test_patched_changes_the_model_inside_and_restores_it_exactly():
    """Inside: VisualKV's attention named on the decoder's config and the vision tower's (each set directly, so
    the other configs keep theirs), no module's forward replaced; nested entries only count; on error the
    outermost exit restores every attribute, and `implementation` reports the model's own kernel throughout."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    config, top, tower = adapter.text_config, adapter.model.config, adapter.visual.config
    before, top_before, state = dict(vars(config)), dict(vars(top)), model_state(adapter.model)
    assert config._attn_implementation == tower._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), patched(adapter):
        assert config._attn_implementation == "visualkv_sdpa" and implementation(adapter) == "sdpa"
        assert tower._attn_implementation == "visualkv_sdpa_flash_varlen"
        assert not any("forward" in vars(m) for m in adapter.model.modules())
        with patched(adapter):
            pass
        assert config._attn_implementation == "visualkv_sdpa"  # a nested exit leaves the patch on
        assert vars(top) == top_before  # nothing propagated to the other configs
        raise RuntimeError("inside")
    assert vars(config) == before and vars(top) == top_before and model_state(adapter.model) == state
    assert implementation(adapter) == adapter.attn_implementation == "sdpa"
    session = ChatSession(adapter, _config("full", 1))
    session.ask("What?", image_media(112, 84, seed=1))
    with patched(adapter):  # a report written while another chat's turn runs names the model's own kernel
        assert session.report()["model_info"]["attn_implementation"] == "sdpa"


def _attention_dropout(model: torch.nn.Module, p: float) -> list[tuple[torch.nn.Module, float]]:
    """Set every decoder attention module's dropout to `p` (the tiny models have none); returns what to restore."""
    found = [m for m in model.modules() if hasattr(m, "attention_dropout") and isinstance(m.attention_dropout, float)]
    saved = [(m, m.attention_dropout) for m in found]
    for m in found:
        m.attention_dropout = p
    return saved


def _stock_logits(model: torch.nn.Module) -> torch.Tensor:
    """transformers' own forward on a short text, in whatever mode the model is (its dropout seeded)."""
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        return model(input_ids=torch.tensor([[3, 14, 15, 9, 26, 5]])).logits


def _stock_tower(adapter) -> torch.Tensor | None:
    """transformers' own Qwen vision tower on fixed patches of two images of different sizes (chunks of several
    lengths in each layer), or None for a family whose vision attention VisualKV does not route."""
    if adapter.family not in ("qwen2_5_vl", "qwen3_vl"):
        return None
    config, grid = adapter.visual.config, torch.tensor([[1, 16, 12], [1, 8, 8]])
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        return adapter.visual(pixels, grid_thw=grid).pooler_output


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("alias", FAMILIES)
def test_another_thread_sees_the_model_unchanged_during_a_turn(alias, mode):
    """While a turn is inside its prefill, another thread finds every module's `training` flag as the owner left
    it and no module's `forward` replaced, and gets exactly the logits (and Qwen vision tower output) it gets
    alone (stock inference, or a training-mode forward with dropout on); a model left in training mode still
    answers as in eval mode, without its flags being flipped."""
    adapter = get_adapter(alias)
    model = adapter.model
    image, config = image_media(224, 168, seed=1), _config("blockwise-keydiff", 1, max_new_tokens=3)
    evaluated = ChatSession(adapter, config).ask("What?", image).token_ids
    saved = _attention_dropout(model, 0.5)
    model.train(mode == "train")
    try:
        flags = {name: m.training for name, m in model.named_modules()}
        alone, tower_alone = _stock_logits(model), _stock_tower(adapter)
        inside, resume, answer = threading.Event(), threading.Event(), []

        def on_block(event) -> None:
            if event.index == 0:  # the turn waits here, inside its prefill's patch
                inside.set()
                resume.wait(timeout=120)

        turn = threading.Thread(
            target=lambda: answer.append(ChatSession(adapter, config).ask("What?", image, on_block=on_block))
        )
        turn.start()
        try:
            assert inside.wait(timeout=120), "the turn never reached its first block"
            seen_flags = {name: m.training for name, m in model.named_modules()}
            seen_forwards = [name for name, m in model.named_modules() if "forward" in vars(m)]
            during, tower_during = _stock_logits(model), _stock_tower(adapter)
        finally:
            resume.set()
            turn.join(timeout=120)
    finally:
        model.eval()
        for module, p in saved:
            module.attention_dropout = p
    assert seen_flags == flags and not seen_forwards
    assert torch.equal(during, alone)
    assert tower_alone is None or torch.equal(tower_during, tower_alone)
    assert answer and answer[0].token_ids == evaluated  # dropout off in the turn's thread: the eval-mode answer


def test_chats_in_threads_share_one_patch_and_leave_the_model_untouched():
    """Two chats on one model from two threads (as the app serves them), held inside their prefills at the same
    time: both answer as they do alone, and the model is untouched once both are done."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    image = image_media(224, 168, seed=1)
    state = model_state(adapter.model)
    config = _config("blockwise-keydiff", 1, max_new_tokens=3)
    alone = ChatSession(adapter, config).ask("What?", image).token_ids
    both_inside = threading.Barrier(2, timeout=60)
    depths: list[int] = []

    def on_block(event) -> None:
        if event.index == 0:  # both threads wait here, each inside its own prefill's patch
            both_inside.wait()
            depths.append(_PATCHES[adapter.model].depth)

    answers: list[list[int]] = []
    threads = [
        threading.Thread(
            target=lambda: answers.append(ChatSession(adapter, config).ask("What?", image, on_block=on_block).token_ids)
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [alone, alone]
    assert min(depths) >= 2  # the two prefills overlapped inside one patch
    assert model_state(adapter.model) == state


def test_a_tower_patch_and_its_model_patch_leave_no_override_whatever_order_they_exit():
    """`patched(tower)` and `patched(adapter)` override the same vision config; each may exit first."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    state, tower = model_state(adapter.model), adapter.visual.config
    model_patch, tower_patch = patched(adapter), patched(adapter.visual)
    model_patch.__enter__()
    tower_patch.__enter__()
    model_patch.__exit__(None, None, None)  # the model's patch leaves first: the tower still attends in one call
    assert tower._attn_implementation == "visualkv_sdpa_flash_varlen"
    tower_patch.__exit__(None, None, None)
    assert model_state(adapter.model) == state and tower._attn_implementation == "sdpa"


def test_under_accelerate_hooks_the_hooked_forward_runs_and_stays():
    """accelerate (device_map) wraps a module's `forward`: the patch touches no forward, so the hook runs inside a
    turn and every attribute of the hooked module is as it was after it."""
    adapter = get_adapter("tiny-qwen2.5-vl")
    module = next(m for m in adapter.visual.modules() if type(m).__name__ == "Qwen2_5_VLVisionAttention")
    calls: list[str] = []
    original = module.forward

    def hooked(*args, **kwargs):
        calls.append("hook")
        return original(*args, **kwargs)

    vars(module)["forward"] = hooked
    try:
        before = dict(vars(module))
        ChatSession(adapter, _config("full", 1)).ask("What?", image_media(112, 84, seed=1))
        assert calls and vars(module) == before
    finally:
        vars(module).pop("forward", None)
