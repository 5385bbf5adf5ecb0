"""Device placement on a CPU-only machine: every method x family x media kind runs "on CUDA".

The model is moved to a pretend CUDA device (`tests/fake_cuda.py`: CPU numbers, CUDA device rules), so a
tensor a step creates on the host without saying so, or forgets to move, fails here as it would on a GPU.
The same runs on a real GPU are in tests/test_cuda.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.conftest import FAMILIES, get_adapter
from tests.fake_cuda import CUDA, FakeCudaTensor, fake_cuda, fake_cuda_adapter
from visualkv.methods import METHODS
from visualkv.runtime.session import ChatSession, SessionConfig

#: every family, the newer three included (conftest's FAMILIES are the two the other suites run)
ALL_FAMILIES = [*FAMILIES, "tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]


def _config(method: str, temperature: float, **extra) -> SessionConfig:
    budget = 48 if METHODS[method].needs_budget else None
    return SessionConfig(method=method, budget=budget, max_new_tokens=3, temperature=temperature, seed=3, **extra)


def _assert_cache_on_cuda(session: ChatSession) -> None:
    for layer in session.cache.layers:
        if layer.is_initialized:
            assert isinstance(layer.keys, FakeCudaTensor) and isinstance(layer.values, FakeCudaTensor)
            for seg in layer.quant.values():
                assert isinstance(seg.keys.data, FakeCudaTensor)


def _two_turns(adapter, config: SessionConfig, media) -> ChatSession:
    session = ChatSession(adapter, config)
    session.ask("What is in it?", media)
    session.ask("And what else?")  # a follow-up turn on the same cache
    return session


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_every_method_runs_on_cuda(alias, method, small_image, small_video):
    """The pretend GPU computes CPU numbers and its generators are CPU generators, so each turn gives exactly the
    CPU run's tokens and holds exactly its KV bytes: a step that went wrong on the device changes them."""
    adapter = fake_cuda_adapter(alias)
    # greedy on the image, sampled on the video (the sampler's generator must be on the logits' device);
    # the image's answers run the fixed-shape step a CUDA graph would capture, the video's plain steps
    for media, temperature, decode in ((small_image, 0.0, "static"), (small_video, 0.8, "eager")):
        config = _config(method, temperature, decode=decode)
        reference = _two_turns(get_adapter(alias), config, media).report()
        with fake_cuda():
            assert adapter.device == CUDA
            s = _two_turns(adapter, config, media)
            _assert_cache_on_cuda(s)
            report = s.report()
        assert [t["token_ids"] for t in report["turns"]] == [t["token_ids"] for t in reference["turns"]]
        assert len(report["turns"][0]["token_ids"]) == 3  # max_new_tokens: the comparison is not of empty answers
        for key in ("peak_kv_bytes", "final_kv_bytes", "full_kv_bytes"):
            assert report[key] == reference[key] > 0, key


@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_vision_ahead_runs_on_cuda(alias, small_image, small_video):
    """Several blocks' media per tower call (strips, temporal patches, tiles batched) on the pretend GPU."""
    adapter = fake_cuda_adapter(alias)
    with fake_cuda():
        for media in (small_image, small_video):
            config = _config("blockwise-keydiff", 0.0, decode="static", block_size=32, prefill="blockwise")
            s = ChatSession(adapter, dataclasses.replace(config, vision_ahead=4))
            s.ask("What is in it?", media)
            _assert_cache_on_cuda(s)
            assert s.turns[0].token_ids


@pytest.mark.parametrize("method", [name for name, cls in METHODS.items() if cls.query_aware])
def test_followup_reprefill_runs_on_cuda(method, small_image):
    adapter = fake_cuda_adapter(FAMILIES[0])
    with fake_cuda():
        s = ChatSession(adapter, _config(method, 0.0, followup="reprefill", decode="static"))
        s.ask("What is in it?", small_image)
        s.ask("Where is the red part?")
        _assert_cache_on_cuda(s)


def test_failed_graph_capture_falls_back_to_plain_decoding(small_image):
    """`auto` on a CUDA device tries a CUDA graph; when capture fails (here: no driver behind the pretend GPU) the
    answer is decoded with plain steps, the reason is recorded and warned once, and later turns do not retry."""
    adapter = fake_cuda_adapter(FAMILIES[0])
    with fake_cuda():
        s = ChatSession(adapter, _config("blockwise-keydiff", 0.0))
        with pytest.warns(UserWarning, match="CUDA graph decoding unavailable"):
            s.ask("What is in it?", small_image)
        s.ask("And what else?")
        modes = [t.decode_mode for t in s.turns]
        assert all(m.startswith("eager (graph capture failed: ") for m in modes) and len(modes) == 2
        assert all(len(t.token_ids) == 3 for t in s.turns)


def test_fake_cuda_catches_a_host_tensor_mixed_in():
    """The harness itself: a CPU tensor meeting a CUDA one fails, CPU indices into CUDA are allowed."""
    with fake_cuda():
        x = torch.ones(4, device="cuda")
        assert x.device == CUDA and isinstance(x * 2, FakeCudaTensor)
        assert x[torch.tensor([0, 2])].device == CUDA  # CPU index into a CUDA tensor: allowed by PyTorch
        assert (x + torch.tensor(1.0)).device == CUDA  # 0-dim CPU tensors mix freely
        assert x.cpu().device.type == "cpu"
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(4)
        with pytest.raises(RuntimeError, match="same device"):
            torch.arange(4)[x > 0]  # a CUDA mask indexing a CPU tensor
        with pytest.raises(RuntimeError, match="same device"):
            torch.multinomial(x / 4, 1, generator=torch.Generator())  # CPU generator, CUDA probabilities
        torch.multinomial(x / 4, 1, generator=torch.Generator(device="cuda"))
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()  # a view or report that forgets .cpu() fails as on a GPU
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            np.asarray(x)
        assert x.cpu().numpy().tolist() == [1.0] * 4


def test_the_app_chats_compares_and_draws_on_cuda(tmp_path):
    """The app on a (pretend) GPU: a chat turn with an image, a follow-up, every view of every layer and a
    Compare of every method go through the handlers with the model on CUDA, and nothing fails (the GPU machine
    this project is lent has no gradio, so this is where the app's device handling is checked)."""
    from types import SimpleNamespace

    from PIL import Image

    from ui import views as result_views
    from ui.callbacks import Callbacks
    from ui.state import ModelCache, UserState
    from visualkv.bench.synthetic import synthetic_image

    alias = FAMILIES[0]
    png = tmp_path / "scene.png"
    Image.fromarray(synthetic_image(448, 336, seed=1)).save(png)
    cache = ModelCache(device="cuda")
    cache._adapters[alias] = fake_cuda_adapter(alias)  # loaded once, moved to the pretend GPU
    h, state = Callbacks.create(cache, alias), UserState(model_name=alias)
    who = SimpleNamespace(session_hash="gpu-user")
    with fake_cuda() as mode:
        for method in ("salicache", "lightkv"):  # the two with their own views (tiers and saliency, merges)
            state.new_chat()
            for text, files in (("What is in it?", [str(png)]), ("And what else?", [])):
                message = {"text": text, "files": files}
                args = (method, 48, 10, 32, 3, 0.7, "reuse", "blockwise", 1, 1.0, 8)
                outs = list(h.turns.chat(who, message, state, *args))
                errors = [o[3] for o in outs if isinstance(o[3], str) and o[3].startswith("⚠️")]
                assert not errors, errors  # the error line stays empty
            assert state.session.cache is not None and len(state.session.turns) == 2
            _assert_cache_on_cuda(state.session)
            for layer in (None, "layer 0", "layer 1"):
                views = result_views.views(state, layer)
                assert views is not None
        rows = None
        args = ("What is in it?", str(png), False, "full", 48, 10, 32, 3, 0.0, "reuse", "blockwise", 1, 1.0, 8)
        for table, _fig, status, _state in h.comparisons.compare(who, state, list(METHODS), *args):
            rows = table if isinstance(table, list) else rows
        assert rows is not None and len(rows) == len(METHODS), status
        assert not mode.mixes
