"""The engine on a real CUDA GPU (marked `cuda`; skipped with a reason where there is none).

Run with `python -m pytest -q -m cuda` on a GPU machine (scripts/gpu_check.sh does, and saves the log).
The CPU-side stand-in for the device checks is tests/test_device.py (a pretend GPU with CUDA's device rules).

bfloat16 tolerance. A bf16 value carries 8 significant bits (relative rounding up to 2^-9 ~ 0.2 %), and our
engine and transformers do not run the same kernels in the same order (one decoder layer at a time over a
cache plus an explicit mask, blocks of 64 tokens, vs one whole-sequence forward with the causal flag), so
the two round differently at every layer. Exactness on CUDA in bf16 therefore means: last-token logits within
3 % of the reference's largest |logit| (max abs difference), the same top-1 token, and the same greedy tokens
for as long as the reference's own top-1 / top-2 margin stays above that tolerance (past a near-tie, either
token is a correct rounding). The same checks run in float32 on the GPU (TF32 off) with an absolute 1e-3
(float32 rounds at 6e-8 relative; kernels on the GPU still reduce in another order than on the CPU, where
tests/test_invariants.py keeps 1e-4). On the tiny test models logits are small and close together, so in
bf16 the token check often covers few tokens; float32 is where greedy tokens must match in full.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import FAMILIES, cache_entries
from visualkv.kv.cache import CompressibleLayer
from visualkv.methods import METHODS
from visualkv.models.registry import load_model
from visualkv.runtime.session import ChatSession, SessionConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]

#: every family, the newer three included (conftest's FAMILIES are the two the CPU suites share)
ALL_FAMILIES = [*FAMILIES, "tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]
PROMPT = "What is in the picture?"
LOGIT_TOLERANCE = 0.03  # bf16: of the reference's largest |logit|; see the module docstring
FLOAT32_TOLERANCE = 1e-3  # float32: absolute
#: settings under which every method keeps everything (budget >= input, P = 0, all FP16 and tau_t = 0)
NO_OP = {
    "full": {},
    "blockwise-keydiff": {"budget": 100_000},
    "blockwise-snapkv": {"budget": 100_000},
    "post-snapkv": {"budget": 100_000},
    "salicache": {"method_options": {"tiers": "1,0,0", "flow_threshold": 0.0}},
    "lightkv": {"method_options": {"ratios": 0.0}},
}
_ADAPTERS: dict = {}


def cuda_adapter(alias: str, dtype: str = "bfloat16"):
    if (alias, dtype) not in _ADAPTERS:
        _ADAPTERS[alias, dtype] = load_model(alias, device="cuda", dtype=dtype)
    return _ADAPTERS[alias, dtype]


def _session(adapter, method, **kw) -> ChatSession:
    kw.setdefault("max_new_tokens", 6)
    if METHODS[method].needs_budget:
        kw.setdefault("budget", 48)
    return ChatSession(adapter, SessionConfig(method=method, **kw))


def _hf_reference(adapter, media, new_tokens=6):
    """transformers' own forward and greedy `generate` on the same device and dtype."""
    proc = adapter.processor
    text = adapter.chat_text(media, PROMPT)
    if media.kind == "image":
        pil = Image.fromarray(media.frames[0])
        enc = proc(text=[text], images=[[pil]] if adapter.family == "smolvlm" else [pil], return_tensors="pt")
    else:
        from visualkv.models.base import video_metadata

        enc = proc(
            text=[text],
            videos=[torch.from_numpy(np.stack(media.frames))],
            video_metadata=[video_metadata(media)],
            do_sample_frames=False,
            return_tensors="pt",
        )
    enc = {k: v.to(adapter.device) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}
    with torch.no_grad():
        logits = adapter.model(**enc).logits[0, -1].float()
        out = adapter.model.generate(
            **enc, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, output_scores=True
        )
    tokens = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
    return logits, tokens, [s[0].float() for s in out.scores]


@pytest.fixture
def no_tf32():
    """float32 means float32: no TF32 matmuls or convolutions (cuDNN allows TF32 by default)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _tolerance(dtype: str, ref_logits: torch.Tensor) -> float:
    return FLOAT32_TOLERANCE if dtype == "float32" else LOGIT_TOLERANCE * float(ref_logits.abs().max())


def _trusted_prefix(tokens, scores, tolerance) -> list[int]:
    """Reference tokens up to the first step whose top-1 / top-2 margin is within the tolerance."""
    out = []
    for token, s in zip(tokens, scores):
        top2 = s.topk(2).values
        if float(top2[0] - top2[1]) <= tolerance:
            break
        out.append(token)
    return out


# -- every method x family x media kind -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_every_method_runs_on_cuda(alias, method, small_image, small_video):
    adapter = cuda_adapter(alias)
    for media in (small_image, small_video):
        for temperature in (0.0, 0.8):
            s = _session(adapter, method, temperature=temperature, max_new_tokens=4)
            s.ask(PROMPT, media)
            s.ask("And what else?")
            for layer in s.cache.layers:
                assert layer.keys.device.type == "cuda" and layer.token_index.device.type == "cuda"
            report = s.report()
            assert all(t["token_ids"] for t in report["turns"])
            assert report["cuda_peak_bytes"] and report["turns"][1]["cuda_peak_bytes"]


@pytest.mark.parametrize("method", [m for m, cls in METHODS.items() if cls.query_aware])
def test_followup_reprefill_on_cuda(method, small_image):
    s = _session(cuda_adapter(FAMILIES[0]), method, followup="reprefill")
    s.ask(PROMPT, small_image)
    assert s.ask("Where is the red part?").token_ids


@pytest.mark.parametrize("method", ["blockwise-snapkv", "salicache"])
def test_a_parked_session_is_pinned_and_its_followup_equals_an_unparked_one_on_cuda(method, small_image):
    """Between turns a parked session's tensors are in page-locked host memory (so the next turn's copy to the
    GPU runs asynchronously), and its follow-up gives the tokens and cache of a session that never parked."""
    adapter = cuda_adapter(FAMILIES[0])
    parked, kept = (_session(adapter, method, park_cache=mode) for mode in ("always", "never"))
    for question in (PROMPT, "And what else?"):
        parked.ask(question, small_image if question == PROMPT else None)
        kept.ask(question, small_image if question == PROMPT else None)
        homes = parked.park_stats.homes
        assert homes and all(device.startswith("cuda") for _, device in homes)
        assert all(t.device.type == "cpu" and t.is_pinned() for t, _ in homes)
        assert parked.cache.layers[0].keys.is_pinned() and kept.cache.layers[0].keys.is_cuda
    assert [t.token_ids for t in parked.turns] == [t.token_ids for t in kept.turns]
    ours, reference = cache_entries(parked), cache_entries(kept)
    assert len(ours) == len(reference) > 0 and all(torch.equal(a, b) for a, b in zip(ours, reference))


def test_sampling_is_seeded_on_cuda(small_image):
    adapter = cuda_adapter(FAMILIES[0])
    runs = [
        _session(adapter, "blockwise-keydiff", temperature=1.0, seed=5).ask(PROMPT, small_image).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# -- exactness against transformers on the same device and dtype ------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_bulk_matches_transformers_on_cuda(dtype, small_image, small_video, no_tf32):
    for alias in ALL_FAMILIES:
        adapter = cuda_adapter(alias, dtype)
        for media in (small_image, small_video):
            ref_logits, ref_tokens, scores = _hf_reference(adapter, media)
            s = _session(adapter, "full")
            record = s.ask(PROMPT, media)
            tol = _tolerance(dtype, ref_logits)
            assert float((s.prefill_result.logits - ref_logits).abs().max()) <= tol
            trusted = _trusted_prefix(ref_tokens, scores, tol)
            assert record.token_ids[: len(trusted)] == [t for t in trusted if t not in adapter.eos_token_ids]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", list(METHODS))
def test_forced_blocks_without_eviction_match_transformers_on_cuda(method, dtype, small_image, small_video, no_tf32):
    """Budget >= input, blocks forced: SmolVLM, LLaVA-OneVision and InternVL images and videos, Qwen videos
    (Qwen2.5-VL and Qwen3-VL image strips are inexact: tests/test_invariants.py, tests/test_new_families.py)."""
    cases = [
        (a, m)
        for a in ALL_FAMILIES
        for m in (small_image, small_video)
        if not (a.startswith("tiny-qwen") and m.kind == "image")
    ]
    for alias, media in cases:
        adapter = cuda_adapter(alias, dtype)
        ref_logits, ref_tokens, scores = _hf_reference(adapter, media)
        s = _session(adapter, method, prefill="blockwise", block_size=64, **NO_OP[method])
        record = s.ask(PROMPT, media)
        assert len(s.blocks) > 3  # really block by block
        tol = _tolerance(dtype, ref_logits)
        assert float((s.prefill_result.logits - ref_logits).abs().max()) <= tol, (alias, media.kind)
        trusted = [t for t in _trusted_prefix(ref_tokens, scores, tol) if t not in adapter.eos_token_ids]
        assert record.token_ids[: len(trusted)] == trusted


# -- the M + b bound ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["blockwise-keydiff", "blockwise-snapkv"])
def test_entries_never_exceed_budget_plus_block_on_cuda(method, small_image, small_video, monkeypatch):
    seen: list[int] = []
    original = CompressibleLayer.update

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(int(self.total_entries_per_head()))
        return out

    monkeypatch.setattr(CompressibleLayer, "update", spy)
    for alias in ALL_FAMILIES:
        for media in (small_image, small_video):
            seen.clear()
            budget = 48
            s = _session(
                cuda_adapter(alias), method, budget=budget, prefill="blockwise", block_size=70, max_new_tokens=3
            )
            s.ask(PROMPT, media)
            protected = int((~s.prepared.visual_mask).sum()) + 3
            largest_block = max(b.n_visual for b in s.prefill_result.context.blocks)
            assert max(seen) <= budget + largest_block + protected
            for layer in s.cache.layers:
                visual = s.prefill_result.context.is_visual(layer.token_index)
                assert int(visual[0].sum(-1).max()) <= budget


# -- the CUDA peak is per turn -----------------------------------------------------------------------------------------
def test_cuda_peak_is_reset_for_every_turn(small_image):
    import gc

    adapter = cuda_adapter(FAMILIES[0])
    s = _session(adapter, "blockwise-keydiff", max_new_tokens=3)
    s.ask(PROMPT, small_image)
    # the peak counts everything the process holds on the GPU (earlier tests' cached models and graph pools
    # too; on the H200 that was 1.2 GB), so the turn is judged against what was allocated before it
    gc.collect()
    before = torch.cuda.memory_allocated()
    scratch_bytes = 4 << 30  # a 4 GiB allocation between the turns, freed before the next one
    scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=adapter.device)
    del scratch
    record = s.ask("And what else?")
    # the tiny model's follow-up adds far less than 4 GiB; without the reset the scratch would be in the peak
    assert before <= record.cuda_peak_bytes < before + scratch_bytes
    assert s.report()["cuda_peak_bytes"] == record.cuda_peak_bytes


@pytest.mark.parametrize("media_kind", ["image", "video"])
@pytest.mark.parametrize("method", ["full", "blockwise-keydiff"])
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_memory_guard_estimate_bounds_the_cuda_peak(alias, method, media_kind, small_image):
    """The guard's estimate (what a prefill still has to allocate) is within [0.9, 1.35] x what the turn's prefill
    really allocated on the GPU in bf16: CUDA's peak over what was allocated before it (docs/RESULTS.md's guard
    table is measured on CPU, by RSS, within the same bounds)."""
    import gc

    from visualkv.bench.synthetic import image_media, video_media
    from visualkv.methods import method_traits
    from visualkv.runtime.memory_guard import MemoryGuard, estimate_prefill

    adapter = cuda_adapter(alias)
    media = image_media(1920, 1080, seed=3) if media_kind == "image" else video_media(24, 640, 360, seed=2)
    budget = 64 if method_traits(method).needs_budget else None
    config = SessionConfig(method=method, budget=budget, max_new_tokens=2, decode="eager")
    unguarded = MemoryGuard(enabled=False)
    ChatSession(adapter, config, guard=unguarded).ask(PROMPT, small_image)  # one-time allocations (cuBLAS, ...)
    prepared = adapter.prepare(media, PROMPT)
    estimate = estimate_prefill(
        adapter, prepared, method_traits(method), budget, None, None, headroom=config.cache_headroom
    )
    session = ChatSession(adapter, config, guard=unguarded)
    prepare = adapter.prepare
    base = [0]

    def prepared_then_baseline(*args, **kwargs):  # measured from where the guard runs, as scripts/guard_check.py
        out = prepare(*args, **kwargs)
        gc.collect()
        torch.cuda.synchronize()
        base[0] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return out

    adapter.prepare = prepared_then_baseline
    try:
        session.ask(PROMPT, media)
    finally:
        del adapter.prepare  # back to the class's method
    measured = torch.cuda.max_memory_allocated() - base[0]
    assert 0 < 0.9 * measured <= estimate.to_allocate <= 1.35 * measured, (estimate.to_allocate / measured, estimate)


# -- shape models on the GPU --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias",
    [
        "shape-qwen2.5-vl-7b",
        "shape-qwen2.5-vl-3b",
        "shape-smolvlm2-2.2b",
        "shape-qwen3-vl-8b",
        "shape-llava-onevision-7b",
        "shape-internvl3.5-8b",
    ],
)
def test_shape_model_builds_on_cuda_in_bf16(alias, small_image):
    from visualkv.models.synthetic.shapes import parameter_count

    adapter = load_model(alias, device="cuda")
    try:
        params = list(adapter.model.parameters())
        assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
        assert sum(p.numel() for p in params) == parameter_count(alias)
        s = _session(adapter, "blockwise-keydiff", budget=256, max_new_tokens=2)
        assert s.ask(PROMPT, small_image).token_ids
    finally:
        del adapter
        torch.cuda.empty_cache()


# -- CUDA-graph decoding (visualkv.runtime.static_decode) -----------------------------------------------------------------------
@pytest.mark.parametrize("method", ["full", "blockwise-keydiff", "salicache", "lightkv", "blockwise-keydiff+salicache"])
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_graph_decode_matches_eager_on_cuda(alias, method, small_image, small_video, no_tf32):
    """float32 (TF32 off): the replayed graph gives the plain decode's tokens over two turns, and `auto` picks it;
    with the grouped window attention (`decode_attention="grouped"`) too."""
    adapter = cuda_adapter(alias, "float32")
    media = small_video if "salicache" in method else small_image
    budget = 48 if method.startswith("blockwise") else None
    turns = {}
    for decode, attention in (("eager", "auto"), ("auto", "auto"), ("graph", "grouped")):
        config = SessionConfig(
            method=method, budget=budget, max_new_tokens=12, decode=decode, decode_attention=attention
        )
        s = ChatSession(adapter, config)
        s.ask(PROMPT, media)
        s.ask("And what else?")
        turns[decode] = (s.turns, s.cache.entries_per_layer())
    eager, eager_entries = turns["eager"]
    for decode, attention in (("auto", "model"), ("graph", "grouped")):  # tiny windows: auto keeps the model's
        graph, graph_entries = turns[decode]
        assert [(t.decode_mode, t.decode_attention) for t in graph] == [("graph", attention)] * 2
        assert [t.token_ids for t in graph] == [t.token_ids for t in eager] and graph_entries == eager_entries


def test_grouped_decode_attention_is_as_precise_as_sdpa_on_cuda():
    """bf16, one query over a long masked window at Qwen2.5-VL-7B's heads: `one_query` (float32 scores through
    bmm's out_dtype) is at least as close to a float64 reference as the masked SDPA kernel it replaces."""
    from visualkv.attention import packed as packed_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, written, heads, kv_heads, dim = 20_000, 19_950, 28, 4, 128

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q, k, v = rand(1, heads, 1, dim, scale=2.0), rand(1, kv_heads, n, dim, scale=2.0), rand(1, kv_heads, n, dim)
    mask = (torch.arange(n, device="cuda") < written).view(1, 1, 1, n)
    group = heads // kv_heads
    k64, v64 = (t.double().repeat_interleave(group, dim=1)[:, :, :written] for t in (k, v))
    reference = torch.softmax(q.double() @ k64.transpose(-1, -2) / dim**0.5, dim=-1) @ v64  # (1, H, 1, d)
    ours = packed_attention.one_query(q, k, v, mask, [], None)[0].transpose(1, 2)  # (1, H, 1, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=mask
    )
    assert packed_attention._float_out_matmul(q), "bmm(out_dtype=float32) is missing: scores round to bf16"
    ours_error = float((ours.double() - reference).abs().max())
    sdpa_error = float((sdpa.double() - reference).abs().max())
    # one bf16 ulp of the output's largest value on top: the probabilities are rounded to bf16 before P @ V, as
    # the fused kernels do too. Scores rounded to bf16 fail this (on a CPU, where out_dtype is missing, the same
    # draw gives 0.030 against SDPA's 0.0038 and a bound of 0.015; float32 scores give 0.0062)
    assert ours_error <= 2 * sdpa_error + 2**-8 * float(reference.abs().max()), (ours_error, sdpa_error)


def test_graph_decode_in_bf16_on_cuda(small_image):
    """bf16, the dtype users run: graph decoding is chosen, every turn, and stopping mid-answer keeps the chat going."""
    import threading

    adapter = cuda_adapter(FAMILIES[0])
    s = _session(adapter, "blockwise-keydiff", max_new_tokens=32)
    stop = threading.Event()
    for _ in s.stream(PROMPT, small_image, stop=stop):
        # >=, not ==: a piece is yielded only when text completes, and random weights' byte tokens often do not
        if len(s.turns[-1].token_ids) >= 5:
            stop.set()
    s.ask("And what else?")
    assert [t.decode_mode for t in s.turns] == ["graph", "graph"]
    assert s.turns[0].stopped == "stopped" and len(s.turns[1].token_ids) > 0
    assert s.turns[1].decode_tokens_per_second > 0


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-smolvlm2"])
def test_graph_decoded_turns_leave_the_model_untouched_on_cuda(alias, small_image):
    """The graph is captured inside `visualkv.attention.patched` and replayed outside it: after turns of packed
    tiers and block-wise eviction the model's state and transformers' own outputs are exactly as before."""
    from tests.test_model_untouched import model_state

    adapter = cuda_adapter(alias)
    logits, tokens, _ = _hf_reference(adapter, small_image)
    state = model_state(adapter.model)
    for method, budget in (("blockwise-keydiff+salicache", 48), ("lightkv", None)):
        s = ChatSession(adapter, SessionConfig(method=method, budget=budget, max_new_tokens=6, decode="graph"))
        s.ask(PROMPT, small_image)
        s.ask("And what else?")
        assert [t.decode_mode for t in s.turns] == ["graph", "graph"]
    assert model_state(adapter.model) == state
    again_logits, again_tokens, _ = _hf_reference(adapter, small_image)
    assert torch.equal(again_logits, logits) and again_tokens == tokens


@pytest.mark.parametrize("alias", ALL_FAMILIES)
@pytest.mark.parametrize("method", ["blockwise-keydiff", "blockwise-snapkv"])
def test_vision_ahead_matches_a_call_per_block_on_cuda(alias, method, small_image, small_video, no_tf32):
    """float32 (TF32 off): several blocks' media in one tower call give the logits and tokens of a call per
    block (tests/test_vision_ahead.py on CPU), and fewer calls."""
    adapter = cuda_adapter(alias, "float32")
    for media in (small_image, small_video):
        runs = {}
        for ahead in (1, 4):
            s = ChatSession(
                adapter,
                SessionConfig(
                    method=method, budget=48, block_size=64, prefill="blockwise", max_new_tokens=6, vision_ahead=ahead
                ),
            )
            record = s.ask(PROMPT, media)
            runs[ahead] = (s.prefill_result.logits.float(), record.token_ids)
        (l1, t1), (l4, t4) = runs[1], runs[4]
        assert (l1 - l4).abs().max() <= FLOAT32_TOLERANCE and t1 == t4, media.kind


# -- device "auto" (device_map="auto") and the CLI on the GPU ---------------------------------------------------------
@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    """Each family's tiny model written as a local checkpoint: loading it goes through `from_pretrained` with
    `device_map`, the path a Hub id or a local folder takes (the offline aliases are built, not loaded)."""
    from visualkv.models.synthetic.tiny import save_tiny

    return {alias: save_tiny(alias, tmp_path_factory.mktemp(alias), dtype=torch.bfloat16) for alias in FAMILIES}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("alias", FAMILIES)
def test_device_auto_loads_with_device_map_and_runs_every_method(
    alias, method, saved_checkpoints, small_image, small_video
):
    """`--device auto` on a local checkpoint: transformers places it (device_map="auto") on the GPU, and every
    method runs an image chat greedily and a video chat sampled, two turns each, with the cache on the GPU."""
    if ("auto", alias) not in _ADAPTERS:  # loaded once per family, like `cuda_adapter`
        _ADAPTERS["auto", alias] = load_model(saved_checkpoints[alias], device="auto")
    adapter = _ADAPTERS["auto", alias]
    assert adapter.device.type == "cuda" and all(p.device.type == "cuda" for p in adapter.model.parameters())
    for media, temperature in ((small_image, 0.0), (small_video, 0.8)):
        s = _session(adapter, method, max_new_tokens=4, temperature=temperature)
        s.ask(PROMPT, media)
        s.ask("And what else?")
        assert all(t.token_ids for t in s.turns)
        assert all(layer.keys.device.type == "cuda" for layer in s.cache.layers if layer.is_initialized)


@pytest.mark.parametrize(
    ("alias", "method", "media_kind"),
    [("tiny-qwen2.5-vl", "lightkv", "image"), ("tiny-smolvlm2", "blockwise-keydiff", "video")],
)
def test_cli_runs_on_cuda(alias, method, media_kind, tmp_path):
    """`python -m visualkv run --device cuda` as a user runs it, on an image: two
    sampled turns, exit 0, a report whose per-turn CUDA peak is measured."""
    import json
    import subprocess
    import sys

    from visualkv.bench.synthetic import synthetic_image, write_video_file

    if media_kind == "image":
        media = tmp_path / "a.png"
        Image.fromarray(synthetic_image(640, 480, seed=3)).save(media)
    else:
        media = write_video_file(str(tmp_path / "v.mp4"), 6, 320, 240)
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "visualkv",
        "run",
        "--model",
        alias,
        "--device",
        "cuda",
        "--media",
        str(media),
        "--prompt",
        "hi",
        "--prompt",
        "and then?",
        "--method",
        method,
        "--budget",
        "64",
        "--temperature",
        "0.7",
        "--max-new-tokens",
        "4",
        "--json",
        str(report),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(report.read_text())
    assert len(data["turns"]) == 2 and data["cuda_peak_bytes"] > 0


@pytest.mark.parametrize("alias", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_vision_tower_one_call_per_layer_matches_stock_on_cuda(alias):
    """The one-call-per-layer vision attention (flash_attn's varlen kernel where installed, else SDPA over the padded
    layout with a key mask) against transformers' own tower, bf16 on the GPU, images of three sizes in one call."""
    from tests.test_vision_attention import _tower_inputs, _tower_output

    adapter = cuda_adapter(alias)
    pixels, grid = _tower_inputs(adapter, [(1000, 700), (448, 336), (224, 560)])
    pixels, grid = pixels.cuda(), grid.cuda()
    ours = _tower_output(adapter.visual, pixels, grid, stock=False).float()
    stock = _tower_output(adapter.visual, pixels, grid, stock=True).float()
    assert (ours - stock).abs().max().item() <= LOGIT_TOLERANCE * stock.abs().max().item()


@pytest.mark.parametrize("method", ["full", "blockwise-keydiff", "salicache"])
def test_decode_reads_every_eighth_token_gives_the_same_answer_on_cuda(method, small_image):
    """Reading sampled tokens back every 8 steps (the accelerator default) gives the per-token loop's answer."""
    adapter = cuda_adapter("tiny-qwen2.5-vl", "float32")
    budget = {"budget": 24} if method.startswith("blockwise") else {}
    answers = []
    for every in (1, 8):
        config = SessionConfig(method=method, max_new_tokens=20, decode_read_every=every, **budget)
        session = ChatSession(adapter, config)
        answers.append(
            [
                session.ask(p, small_image if not i else None).token_ids
                for i, p in enumerate((PROMPT, "And the corner?"))
            ]
        )
    assert answers[0] == answers[1]


# -- no host synchronisation in the layer loop or a decode step, as CUDA itself sees it ---------------------------------
@pytest.mark.parametrize(
    ("method", "decode"),
    [("full", "static"), ("blockwise-keydiff", "static"), ("blockwise-snapkv", "eager"), ("salicache", "eager")],
)
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_layer_loop_and_decode_steps_never_synchronise_on_cuda(alias, method, decode, small_image, small_video):
    """`torch.cuda.set_sync_debug_mode("error")` from the first decoder layer of every block (prefill, follow-up,
    eager decode step) to its last, and over every fixed-shape decode step: any operation that waits for the
    device raises. The CPU suite's list of such operations (tests/test_sync_free.py) is checked against CUDA here."""
    from visualkv.runtime.engine import Engine
    from visualkv.runtime.static_decode import StaticDecoder

    adapter = cuda_adapter(alias)
    media = small_video if method == "salicache" else small_image
    config = {"decode": decode, "prefill": "blockwise", "block_size": 48}
    _session(adapter, method, **config).ask(PROMPT, media)  # warm-up: kernel checks, graph pools, handles
    armed: list[str] = []

    def strict(module, args) -> None:
        torch.cuda.set_sync_debug_mode("error")
        armed.append("layers")

    def run_layers(self, *args, **kwargs):
        handle = self.adapter.layers[0].register_forward_pre_hook(strict)
        try:
            return original_layers(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            handle.remove()

    def step(self, token):  # a graph replay, or the step run plainly where no graph was captured
        torch.cuda.set_sync_debug_mode("error")
        armed.append("step")
        try:
            return original_step(self, token)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    original_layers, original_step = Engine.run_layers, StaticDecoder.step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "run_layers", run_layers)
        patch.setattr(StaticDecoder, "step", step)
        session = _session(adapter, method, **config)
        session.ask(PROMPT, media)
        session.ask("And what else?")
    assert "layers" in armed and (decode == "eager" or "step" in armed), armed
