"""`bench gpu` end to end on CPU with a tiny model and small inputs: the JSON's shape (the reference rows, the
repeats, the limits, the provenance) and relations hold, and a video past the 512-frame cap gives refused rows for
the references and `full` and measured rows for the bounded methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from visualkv.bench import gpu
from visualkv.bench.gpu import GENERATE, GENERATE_STATIC, GpuBenchConfig, markdown_table, run_gpu_bench, save
from visualkv.runtime.frame_cap import FULL_FRAME_CAP

METHODS = ("full", "blockwise-keydiff")
COMPOSED = "blockwise-keydiff+salicache"
REFERENCES = (GENERATE, GENERATE_STATIC, "full")
REPEATS = 2
NEW_TOKENS = 4
TIMED = ("ttft_seconds", "decode_tokens_per_second", "peak_over_weights_bytes")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """The CPU dry run: a 224x224 image and a 4-s (4-frame) video, the references and block-wise KeyDiff, each
    case once untimed and twice timed; every run_case call recorded."""
    cfg = GpuBenchConfig(
        model="tiny-qwen2.5-vl",
        device="cpu",
        methods=METHODS,
        budget=48,
        block_size=32,
        image_size=(224, 224),
        video_seconds=4,
        video_size=(208, 208),
        new_tokens=NEW_TOKENS,
        repeats=REPEATS,
        out=str(tmp_path_factory.mktemp("bench_gpu")),
        video_dir=str(tmp_path_factory.mktemp("videos")),
        session_overrides={"decode": "static"},  # `--decode static`: the CUDA graph's step, without the graph
    )
    seen = []  # (cases so far, complete) at every on_case call
    calls = []  # (case label, media object, new tokens) of every run
    original = gpu.run_case

    def spy(adapter, media, case, cfg):
        calls.append((case.label, media, cfg.new_tokens))
        return original(adapter, media, case, cfg)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu, "run_case", spy)
        res = run_gpu_bench(cfg, log=lambda line: None, on_case=lambda r: seen.append((len(r["cases"]), r["complete"])))
    res["paths"] = save(res, cfg.out)
    res["seen"], res["calls"] = seen, calls
    return res


def _rows(result, kind):
    return {c["method"]: c for c in result["cases"] if c["input"] == kind}


def test_every_case_ran_and_decoded_every_token(result):
    cases = result["cases"]
    assert [(c["input"], c["method"]) for c in cases] == [
        (kind, m) for kind in ("image", "video") for m in (GENERATE, GENERATE_STATIC, *METHODS)
    ]
    assert all("error" not in c for c in cases), [c.get("error") for c in cases]
    assert all(c["new_tokens"] == NEW_TOKENS for c in cases)  # EOS ignored: every case decodes as many tokens
    assert all(c["ttft_seconds"]["min"] > 0 and c["decode_tokens_per_second"]["min"] > 0 for c in cases)
    assert all(c["process_peak_rss_bytes"] > 0 for c in cases)  # host memory, the references' too
    ours = [c for c in cases if c["method"] not in (GENERATE, GENERATE_STATIC)]
    assert all(c["decode_mode"] == "static" for c in ours)
    assert all("decode_mode" not in c and "prefill_attention" not in c for c in cases if c not in ours)
    # the fixed-shape decoder's setup is timed apart: the steady rate leaves it out, the overall one keeps it
    assert all(c["decode_setup_seconds"]["min"] > 0 for c in ours)
    table = markdown_table(result).splitlines()
    assert sum("(static, model) |" in line for line in table) == len(ours)  # auto on CPU: the model's attention
    blockwise = [c for c in ours if c["method"].startswith("blockwise")]
    assert blockwise and all(c["prefill_attention"] == "gqa" for c in blockwise)
    assert sum(" (gqa) |" in line for line in table) == len(blockwise)


def test_each_case_is_warmed_on_its_own_input_then_repeated(result):
    """One untimed run on the very media and token count measured, then the repeats, before the next case."""
    expected = [
        (label, kind, NEW_TOKENS)
        for kind in ("image", "video")
        for label in (GENERATE, GENERATE_STATIC, *METHODS)
        for _ in range(1 + REPEATS)
    ]
    assert [(label, media.kind, n) for label, media, n in result["calls"]] == expected
    for start in range(0, len(expected), 1 + REPEATS):  # the same media object for every run of a case
        assert len({id(media) for _, media, _ in result["calls"][start : start + 1 + REPEATS]}) == 1
    video = [media for _, media, _ in result["calls"] if media.kind == "video"]
    assert not video[0].is_lazy and len({id(m) for m in video}) == 1  # decoded once, before any clock
    assert all(c["warmup_seconds"] > 0 for c in result["cases"])
    assert result["warmup_seconds"] == pytest.approx(sum(c["warmup_seconds"] for c in result["cases"]))


def test_timed_figures_are_median_min_max_over_the_repeats(result):
    for row in result["cases"]:
        for key in ("ttft_seconds", "decode_tokens_per_second"):
            figure = row[key]
            assert set(figure) == {"median", "min", "max", "n"} and figure["n"] == REPEATS, (key, figure)
            assert figure["min"] <= figure["median"] <= figure["max"]
        assert row["peak_over_weights_bytes"] is None and row["allocated_before_bytes"] is None  # no CUDA: null
    for row in _rows(result, "video").values():
        per_hour, ttft = row["ttft_seconds_per_hour"], row["ttft_seconds"]
        assert per_hour["max"] == pytest.approx(ttft["max"] * 3600 / 4) and per_hour["n"] == REPEATS


def test_a_case_figure_is_the_median_of_its_repeats_not_the_mean_or_the_last(monkeypatch):
    """Three repeats with a skewed spread: the median is the middle run, apart from the mean, the last run and
    the warm-up; untimed figures come from the last run."""
    runs = iter([(99.0, 0), (3.0, 1), (1.0, 2), (10.0, 3)])  # the warm-up first, then the repeats

    def fake_run(adapter, media, case, cfg):
        ttft, index = next(runs)
        return {"ttft_seconds": ttft, "decode_tokens_per_second": 2 * ttft, "run": index}

    monkeypatch.setattr(gpu, "run_case", fake_run)
    cfg = GpuBenchConfig(model="tiny-qwen2.5-vl", device="cpu", repeats=3)
    row = gpu.measure_case(None, None, None, cfg)
    assert row["ttft_seconds"] == {"median": 3.0, "min": 1.0, "max": 10.0, "n": 3}
    assert row["decode_tokens_per_second"] == {"median": 6.0, "min": 2.0, "max": 20.0, "n": 3}
    assert row["run"] == 3 and row["warmup_seconds"] > 0


def test_ratios_name_their_reference(result):
    for kind in ("image", "video"):
        rows = _rows(result, kind)
        fastest = min((GENERATE, GENERATE_STATIC), key=lambda m: rows[m]["ttft_seconds"]["median"])
        for row in rows.values():
            best = row["vs_best_generate"]
            assert best["ttft_reference"] == fastest
            ttft = row["ttft_seconds"]["median"] / rows[fastest]["ttft_seconds"]["median"]
            assert best["ttft_seconds"] == pytest.approx(ttft)
            full = row["decode_tokens_per_second"]["median"] / rows["full"]["decode_tokens_per_second"]["median"]
            assert row["vs_full"]["decode_tokens_per_second"] == pytest.approx(full)
        assert rows["full"]["vs_full"]["ttft_seconds"] == 1.0 and rows[GENERATE]["vs_generate"]["ttft_seconds"] == 1.0


def test_generate_reference_runs_on_the_untouched_model(monkeypatch):
    """The reference is transformers as users get it: during `generate` no attention of VisualKV is named and no
    module carries a forward of ours (the sessions' changes live inside their own `patched`)."""
    from tests.conftest import get_adapter
    from visualkv.bench.gpu import run_generate
    from visualkv.bench.synthetic import image_media
    from visualkv.runtime.session import ChatSession, SessionConfig

    adapter = get_adapter("tiny-qwen2.5-vl")
    ChatSession(adapter, SessionConfig(method="full", max_new_tokens=2)).ask("Hi?", image_media(448, 252, seed=1))
    seen = []
    original = adapter.model.generate

    def generate(*args, **kwargs):
        overridden = [m for m in adapter.model.modules() if "forward" in vars(m)]
        seen.append((adapter.text_config._attn_implementation, len(overridden)))
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter.model, "generate", generate)
    run_generate(adapter, image_media(448, 252, seed=1), GpuBenchConfig(device="cpu", new_tokens=2))
    assert seen == [("sdpa", 0)]


def test_partial_results_are_handed_over_after_every_case(result):
    """bench gpu saves after each case, so a run cut short by a time limit keeps what it measured."""
    n = len(result["cases"])
    assert result["seen"] == [(k, False) for k in range(1, n + 1)]
    assert result["complete"] is True


def test_full_cache_equals_generates_cache(result):
    """Same input, same tokens in the cache: our full cache holds exactly the bytes of transformers'."""
    for kind in ("image", "video"):
        rows = _rows(result, kind)
        assert (
            rows["full"]["prompt_tokens"] == rows[GENERATE]["prompt_tokens"] == rows[GENERATE_STATIC]["prompt_tokens"]
        )
        assert rows["full"]["cache_peak_bytes"] == rows[GENERATE]["cache_peak_bytes"] > 0
        assert rows["full"]["vs_generate"]["cache_peak_bytes"] == 1.0


def test_blockwise_cache_peak_is_bounded_and_below_generate(result):
    info = result["model_info"]
    entry = info["layers"] * 2 * info["kv_heads"] * info["head_dim"] * 4  # float32 on CPU
    for kind in ("image", "video"):
        rows = _rows(result, kind)
        bw, ref = rows["blockwise-keydiff"], rows[GENERATE]
        protected = bw["prompt_tokens"] - bw["visual_tokens"] + NEW_TOKENS
        # a block is whole units: a temporal patch (2 in a 4-frame video) or a token row (224 px / 28 = 8)
        largest_unit = bw["visual_tokens"] // 2 if kind == "video" else 8
        assert bw["cache_peak_bytes"] <= (48 + max(32, largest_unit) + protected) * entry
        assert bw["vs_generate"]["cache_peak_bytes"] < 1.0
        assert bw["cache_final_bytes"] < ref["cache_final_bytes"]


def test_json_has_the_references_repeats_limits_and_provenance(result):
    with open(result["paths"][0]) as fh:
        saved = json.load(fh)
    assert saved["machine"].startswith("CPU only") and saved["config"]["new_tokens"] == NEW_TOKENS
    config = saved["config"]
    assert config["repeats"] == REPEATS and config["ttft"].startswith("from the decoded media in host memory")
    assert config["sdpa_backends"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert config["attention_backend"]["sdpa_backends"] == config["sdpa_backends"]
    for kind in ("image", "video"):
        assert [c["method"] for c in saved["cases"] if c["input"] == kind][:3] == list(REFERENCES)
    for row in saved["cases"]:
        assert all(row[key] is None or row[key]["n"] == REPEATS for key in TIMED)
        limits = row["limits"]
        assert limits["prefill_flops"] > 0 and limits["decode_bytes_per_token"] > 0
        assert [limits[k] for k in ("ttft_floor_seconds", "ttft_share")] == [None, None]  # no device peak on CPU
        assert [limits[k] for k in ("decode_ceiling_tokens_per_second", "decode_share")] == [None, None]
    assert saved["device_peaks"] is None and saved["work"]["decode_bytes_per_token"] > 0
    prov = saved["provenance"]
    assert len(prov["commit_sha"]) == 40 and prov["commit"].startswith(prov["commit_sha"][:7])
    assert isinstance(prov["dirty"], bool) and (prov["diff_sha256"] is None) == (not prov["dirty"])
    methods = [c for c in saved["cases"] if c["method"] == "blockwise-keydiff"]
    assert methods and all(c["guard_estimate_bytes"] > 0 for c in methods)  # the guard's estimate, to set beside it
    assert saved["weights_bytes"] > 0
    assert any(p.endswith(".md") for p in result["paths"])


def test_generate_static_asks_transformers_for_a_static_cache(monkeypatch):
    """`generate` is called as a user calls it; `generate-static` adds only cache_implementation="static"."""
    from tests.conftest import get_adapter
    from visualkv.bench.gpu import Case, run_case
    from visualkv.bench.synthetic import image_media

    adapter = get_adapter("tiny-qwen2.5-vl")
    seen = []
    original = adapter.model.generate

    def generate(*args, **kwargs):
        seen.append(kwargs.get("cache_implementation"))
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter.model, "generate", generate)
    cfg = GpuBenchConfig(device="cpu", new_tokens=2)
    for method in (GENERATE, GENERATE_STATIC):
        row = run_case(adapter, image_media(112, 112, seed=1), Case(method), cfg)
        assert row["new_tokens"] == 2
    assert seen == [None, "static"]


def test_without_warmup_each_case_runs_its_repeats_only(monkeypatch, tmp_path):
    calls = []
    original = gpu.run_case

    def spy(adapter, media, case, cfg):
        calls.append(case.label)
        return original(adapter, media, case, cfg)

    monkeypatch.setattr(gpu, "run_case", spy)
    cfg = GpuBenchConfig(
        model="tiny-qwen2.5-vl",
        device="cpu",
        methods=("full",),
        image_size=(112, 112),
        new_tokens=2,
        inputs=("image",),
        out=str(tmp_path),
        warmup=False,
        repeats=1,
    )
    res = run_gpu_bench(cfg, log=lambda line: None)
    assert calls == [GENERATE, GENERATE_STATIC, "full"]
    assert all("warmup_seconds" not in c and c["ttft_seconds"]["n"] == 1 for c in res["cases"])


@pytest.mark.parametrize("model", ["tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"])
def test_newer_families_run_against_generate(model, tmp_path):
    """Every family runs `bench gpu` (the shape-... aliases on a GPU share these code paths): generate on the
    same input fills exactly our full cache, and block-wise stays below it."""
    cfg = GpuBenchConfig(
        model=model,
        device="cpu",
        methods=("full", "blockwise-keydiff"),
        budget=64,
        image_size=(448, 252),
        video_seconds=4,
        video_size=(320, 240),
        new_tokens=3,
        out=str(tmp_path),
        warmup=False,
        repeats=1,
    )
    res = run_gpu_bench(cfg, log=lambda line: None)
    assert all("error" not in c for c in res["cases"]), [c.get("error") for c in res["cases"]]
    for kind in ("image", "video"):
        rows = _rows(res, kind)
        assert rows["full"]["prompt_tokens"] == rows[GENERATE]["prompt_tokens"]
        assert rows["full"]["cache_peak_bytes"] == rows[GENERATE]["cache_peak_bytes"] > 0
        assert rows["blockwise-keydiff"]["cache_peak_bytes"] < rows[GENERATE]["cache_peak_bytes"]


def test_gpu_code_paths_import_without_plotly_gradio_decord_kaleido(tmp_path):
    """The GPU machine has none of them: bench gpu must import and save JSON without them."""
    script = f"""
import sys
from pathlib import Path
for name in ("plotly", "gradio", "decord", "kaleido"):
    sys.modules[name] = None  # any import of them now raises ImportError
import visualkv.cli.main, visualkv.bench, visualkv.runtime.session
from visualkv.bench.gpu import save
paths = save({{"config": {{"model": "m"}}, "machine": "x", "cases": []}}, {str(tmp_path)!r})
assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "md"], paths
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_cli_refuses_a_bad_input_kind(capsys):
    from tests.test_cli import _assert_one_line_error, _run

    code, _, err = _run(capsys, "bench", "gpu", "--inputs", "image,audio")
    _assert_one_line_error(code, err, "audio")
    code, _, err = _run(capsys, "bench", "gpu", "--decode-attention-rows", "model,flash")
    _assert_one_line_error(code, err, "a decode attention is model or grouped, got 'flash'")


# -- a video past the frame cap of full and of the references (the hour-long run of scripts/gpu_check.sh, small) --
PAST_CAP_SECONDS = FULL_FRAME_CAP + 8  # at 1 fps: 520 frames, 8 past the cap


@pytest.fixture(scope="module")
def past_cap(tmp_path_factory):
    """`bench gpu --inputs video --video-seconds 520` through the CLI (default video kind: mix), 208x208 frames (the smallest --video-size)."""
    from visualkv.cli.main import main

    out = tmp_path_factory.mktemp("bench_gpu_past_cap")
    code = main(
        ["bench", "gpu", "--model", "tiny-qwen2.5-vl", "--device", "cpu", "--inputs", "video"]
        + ["--video-seconds", str(PAST_CAP_SECONDS), "--video-size", "208x208", "--video-dir", str(out / "videos")]
        + ["--methods", f"full,blockwise-keydiff,{COMPOSED}", "--budget", "48", "--block-size", "32"]
        + ["--new-tokens", "3", "--repeats", "1", "--no-warmup", "--out", str(out)]
    )
    with open(out / "gpu_tiny-qwen2.5-vl.json") as fh:
        saved = json.load(fh)
    return code, saved, (out / "gpu_tiny-qwen2.5-vl.md").read_text()


def test_past_the_cap_references_and_full_are_refused_rows(past_cap):
    code, saved, table = past_cap
    assert code == 0  # refusals are rows, not failures
    rows = {c["method"]: c for c in saved["cases"]}
    assert list(rows) == [*REFERENCES, "blockwise-keydiff", COMPOSED]
    for method in REFERENCES:
        row = rows[method]
        assert "ttft_seconds" not in row and "error" not in row
        reason = row["refused"]
        assert "\n" not in reason and f"{PAST_CAP_SECONDS} frames" in reason and f"{FULL_FRAME_CAP} frames" in reason
        assert "blockwise-keydiff" in reason  # names the bounded methods
        assert "--video-seconds" in reason and "--max-frames" not in reason  # this command's own option
        assert f"| {method} | refused: " in table


def test_past_the_cap_bounded_methods_are_measured_per_hour(past_cap):
    _, saved, table = past_cap
    assert saved["complete"] is True and saved["config"]["video_kinds"] == ["mix"]
    (video,) = saved["videos"]
    assert video["kind"] == "mix" and video["frames"] == PAST_CAP_SECONDS and video["generation_seconds"] > 0
    info = saved["model_info"]
    entry = info["layers"] * 2 * info["kv_heads"] * info["head_dim"] * 4  # float32 on CPU
    for method in ("blockwise-keydiff", COMPOSED):
        row = next(c for c in saved["cases"] if c["method"] == method)
        assert "refused" not in row and "error" not in row, row
        assert (row["video_kind"], row["video_frames"], row["video_seconds"]) == ("mix", 520, 520)
        ttft, per_hour = row["ttft_seconds"], row["ttft_seconds_per_hour"]
        assert row["new_tokens"] == 3 and ttft["n"] == 1 and ttft["median"] > 0  # --repeats 1
        assert per_hour["median"] == pytest.approx(ttft["median"] * 3600 / PAST_CAP_SECONDS)
        assert "peak_over_weights_bytes" in row and row["peak_over_weights_bytes"] is None  # no CUDA here
        assert row["process_peak_rss_bytes"] > 0 and row["visual_tokens"] > FULL_FRAME_CAP
        protected = row["prompt_tokens"] - row["visual_tokens"] + 3
        assert 0 < row["cache_peak_bytes"] <= (48 + 32 + protected) * entry  # M + b: bounded over 520 frames
        assert row["prefill_attention"] == "gqa"  # its blocks after the cache: grouped-query SDPA on this CPU
        assert f"| {method} | {ttft['median']:.2f} (gqa) | {per_hour['median']:,.0f} |" in table


# -- scripts/device_env_check.sh (the GPU image's versions on CPU) picks a Python 3.12 that runs --


def test_device_env_check_skips_a_python312_that_does_not_run(tmp_path):
    # a pyenv shim named python3.12 is on PATH even when pyenv selects another version; it only fails. The
    # script took it and its venv step died before any check ran.
    script = Path(__file__).resolve().parent.parent / "scripts" / "device_env_check.sh"
    shim = tmp_path / "python3.12"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PY312"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '')}"
    env["VENV"] = str(tmp_path / "venv")  # were the flag ignored, nothing of a real venv is touched
    out = subprocess.run(
        ["bash", str(script), "--which-python"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode == 2:  # no other Python 3.12 on this machine: refused with the reason, not the shim
        assert "no Python 3.12 found" in out.stdout
        return
    assert out.returncode == 0, out.stdout + out.stderr
    chosen = out.stdout.strip()
    assert chosen != str(shim)
    version = subprocess.run(
        [chosen, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == "(3, 12)"


# -- the hardware limits beside the figures (visualkv.bench.limits, visualkv.bench.device_peaks) --


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", (989.5e12, 3.35e12)),  # the SXM board's CUDA name
        ("NVIDIA H100 PCIe", (756.5e12, 2.0e12)),
        ("NVIDIA H200", (989.5e12, 4.8e12)),
        ("NVIDIA A100-SXM4-80GB", (312e12, 2.039e12)),
        ("NVIDIA L4", (121e12, 0.3e12)),
        ("NVIDIA A10G", (125e12, 0.6e12)),
        ("NVIDIA L40S", None),  # "L4" is a whole word, not a prefix
        ("NVIDIA GeForce RTX 4090", None),
        (None, None),
    ],
)
def test_device_peaks_match_the_whole_board_name(name, peak):
    from visualkv.bench.device_peaks import device_peak

    found = device_peak(name)
    got = None if found is None else (found.bf16_flops_per_second, found.memory_bytes_per_second)
    assert got == (peak if peak is None else pytest.approx(peak))
    assert found is None or "datasheet" in found.source


def test_work_counts_follow_the_model_config():
    """Linear weights per patch, per merged token and per prompt token, from the tiny Qwen2.5-VL's config."""
    from tests.conftest import get_adapter
    from visualkv.bench.limits import model_work

    adapter = get_adapter("tiny-qwen2.5-vl")
    text, vision = adapter.text_config, adapter.model.config.vision_config
    h, kv, d, hidden, inter = 4, 2, 16, 64, 128  # tiny-qwen2.5-vl's text config
    assert (text.num_attention_heads, text.num_key_value_heads, text.hidden_size, text.intermediate_size) == (
        h,
        kv,
        hidden,
        inter,
    )
    per_layer = hidden * h * d + 2 * hidden * kv * d + h * d * hidden + 3 * hidden * inter  # q, k, v, o, MLP
    vh, vi = vision.hidden_size, vision.intermediate_size  # 32, 64: qkv, proj and a gated MLP per block
    per_block = vh * 3 * vh + vh * vh + 3 * vh * vi
    merger = (4 * vh) * (4 * vh) + (4 * vh) * vision.out_hidden_size  # 2x2 patches merged into one token
    work = model_work(adapter)
    assert work.llm_linear_params == text.num_hidden_layers * per_layer
    assert work.vision_block_linear_params == vision.depth * per_block
    assert work.vision_other_linear_params == merger
    assert work.patches_per_token == 4
    n, v = 100, 64
    lm_head = hidden * text.vocab_size
    expected = (
        2 * 4 * v * vision.depth * per_block
        + 2 * v * merger
        + 2 * n * text.num_hidden_layers * per_layer
        + 2 * text.num_hidden_layers * h * d * n * n
        + 2 * lm_head
    )
    assert work.prefill_flops(n, v) == expected
    float32 = 4
    layer_params = sum(p.numel() for p in adapter.layers.parameters())
    assert work.decode_bytes_per_token == float32 * (layer_params + hidden + lm_head)  # + the final norm, the LM head


def test_row_limits_divide_by_the_device_peak():
    from visualkv.bench.device_peaks import DevicePeak
    from visualkv.bench.limits import ModelWork, row_limits

    work = ModelWork(0, 0, 10**9, 0, 1, 1, 1, 1, decode_bytes_per_token=2 * 10**9)
    peak = DevicePeak("X", 1e15, 4e12, "test")
    limits = row_limits(
        work, peak, prompt_tokens=1000, visual_tokens=0, ttft_seconds=0.01, decode_tokens_per_second=500
    )
    flops = 2 * 1000 * 10**9 + 2 * 1000 * 1000  # linear + attention (1 layer, 1 head, head_dim 1)
    assert limits["prefill_flops"] == flops
    assert limits["ttft_floor_seconds"] == pytest.approx(flops / 1e15)
    assert limits["ttft_share"] == pytest.approx(0.2000002)
    assert limits["decode_ceiling_tokens_per_second"] == pytest.approx(2000) and limits["decode_share"] == 0.25
    on_cpu = row_limits(work, None, 1000, 0, 0.01, 500)
    assert on_cpu["prefill_flops"] == flops and on_cpu["ttft_share"] is None and on_cpu["decode_share"] is None
