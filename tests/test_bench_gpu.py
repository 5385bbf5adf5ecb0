"""`bench gpu` end to end on CPU with a tiny model and small inputs: the JSON's relations hold, and a video
past the 512-frame cap (read lazily from a generated file) gives refused rows for the reference and `full` and
measured rows for the bounded methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from visualkv.bench.gpu import REFERENCE, GpuBenchConfig, markdown_table, run_gpu_bench, save
from visualkv.methods import FULL_FRAME_CAP

METHODS = ("full", "blockwise-keydiff", "lightkv")
COMPOSED = "blockwise-keydiff+salicache"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    cfg = GpuBenchConfig(
        model="tiny-qwen2.5-vl",
        device="cpu",
        methods=METHODS,
        budget=48,
        block_size=32,
        image_size=(448, 252),
        video_seconds=6,
        video_size=(320, 240),
        new_tokens=5,
        out=str(tmp_path_factory.mktemp("bench_gpu")),
        video_dir=str(tmp_path_factory.mktemp("videos")),
        session_overrides={"decode": "static"},  # `--decode static`: the CUDA graph's step, without the graph
    )
    seen = []  # (cases so far, complete) at every on_case call
    res = run_gpu_bench(cfg, log=lambda line: None, on_case=lambda r: seen.append((len(r["cases"]), r["complete"])))
    res["paths"] = save(res, cfg.out)
    res["seen"] = seen
    return res


def test_every_case_ran_and_decoded_every_token(result):
    cases = result["cases"]
    assert [(c["input"], c["method"]) for c in cases] == [
        (kind, m) for kind in ("image", "video") for m in (REFERENCE, *METHODS)
    ]
    assert all("error" not in c for c in cases), [c.get("error") for c in cases]
    assert all(c["new_tokens"] == 5 for c in cases)  # EOS ignored: every case decodes as many tokens
    assert all(c["ttft_seconds"] > 0 and c["decode_tokens_per_second"] > 0 for c in cases)
    assert all(c["process_peak_rss_bytes"] > 0 for c in cases)  # host memory, the reference's too
    ours = [c for c in cases if c["method"] != REFERENCE]
    assert all(c["decode_mode"] == "static" for c in ours) and all("decode_mode" not in c for c in cases[:1])
    # the fixed-shape decoder's setup is timed apart: the steady rate leaves it out, the overall one keeps it
    assert all(c["decode_setup_seconds"] > 0 for c in ours)
    assert all(c["decode_steady_tokens_per_second"] > c["decode_tokens_per_second"] for c in ours)
    table = markdown_table(result).splitlines()
    assert sum("(static, model) |" in line for line in table) == len(ours)  # auto on CPU: the model's attention
    # every method row with a block after the cache says which kernel attended it (on this CPU: grouped-query SDPA)
    blockwise = [c for c in ours if c["method"].startswith("blockwise")]
    assert blockwise and all(c["prefill_attention"] == "gqa" for c in blockwise)
    assert sum(" (gqa) |" in line for line in table) == sum(bool(c["prefill_attention"]) for c in ours)
    assert all("prefill_attention" not in c for c in cases if c["method"] == REFERENCE)  # generate: its own


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
        rows = {c["method"]: c for c in result["cases"] if c["input"] == kind}
        assert rows["full"]["prompt_tokens"] == rows[REFERENCE]["prompt_tokens"]
        assert rows["full"]["cache_peak_bytes"] == rows[REFERENCE]["cache_peak_bytes"] > 0
        assert rows["full"]["vs_generate"]["cache_peak_bytes"] == 1.0


def test_blockwise_cache_peak_is_bounded_and_below_generate(result):
    info = result["model_info"]
    entry = info["layers"] * 2 * info["kv_heads"] * info["head_dim"] * 4  # float32 on CPU
    for kind in ("image", "video"):
        rows = {c["method"]: c for c in result["cases"] if c["input"] == kind}
        bw, ref = rows["blockwise-keydiff"], rows[REFERENCE]
        protected = bw["prompt_tokens"] - bw["visual_tokens"] + 5
        # a block is whole units: a temporal patch (3 in a 6-frame video) or a token row (448 px / 28 = 16)
        largest_unit = bw["visual_tokens"] // 3 if kind == "video" else 16
        assert bw["cache_peak_bytes"] <= (48 + max(32, largest_unit) + protected) * entry
        assert bw["vs_generate"]["cache_peak_bytes"] < 1.0
        assert bw["cache_final_bytes"] < ref["cache_final_bytes"]


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
    )
    res = run_gpu_bench(cfg, log=lambda line: None)
    assert all("error" not in c for c in res["cases"]), [c.get("error") for c in res["cases"]]
    for kind in ("image", "video"):
        rows = {c["method"]: c for c in res["cases"] if c["input"] == kind}
        assert rows["full"]["prompt_tokens"] == rows[REFERENCE]["prompt_tokens"]
        assert rows["full"]["cache_peak_bytes"] == rows[REFERENCE]["cache_peak_bytes"] > 0
        assert rows["blockwise-keydiff"]["cache_peak_bytes"] < rows[REFERENCE]["cache_peak_bytes"]


def test_json_and_table_are_written_without_cuda_fields(result):
    with open(result["paths"][0]) as fh:
        saved = json.load(fh)
    assert saved["machine"].startswith("CPU only") and saved["config"]["new_tokens"] == 5
    assert all(c["peak_over_weights_bytes"] is None for c in saved["cases"])  # no CUDA here: null, not 0
    methods = [c for c in saved["cases"] if c.get("method") == "blockwise-keydiff" and not c.get("refused")]
    assert methods and all(c["guard_estimate_bytes"] > 0 for c in methods)  # the guard's estimate, to set beside it
    assert saved["weights_bytes"] > 0
    assert any(p.endswith(".md") for p in result["paths"])


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


# -- a video past the frame cap of full and of the reference (the hour-long run of scripts/gpu_check.sh, small) --
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
        + ["--new-tokens", "3", "--out", str(out)]
    )
    with open(out / "gpu_tiny-qwen2.5-vl.json") as fh:
        saved = json.load(fh)
    return code, saved, (out / "gpu_tiny-qwen2.5-vl.md").read_text()


def test_past_the_cap_reference_and_full_are_refused_rows(past_cap):
    code, saved, table = past_cap
    assert code == 0  # refusals are rows, not failures
    rows = {c["method"]: c for c in saved["cases"]}
    assert list(rows) == [REFERENCE, "full", "blockwise-keydiff", COMPOSED]
    for method in (REFERENCE, "full"):
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
        assert row["new_tokens"] == 3 and row["ttft_seconds"] > 0
        assert row["ttft_seconds_per_hour"] == pytest.approx(row["ttft_seconds"] * 3600 / PAST_CAP_SECONDS)
        assert "peak_over_weights_bytes" in row and row["peak_over_weights_bytes"] is None  # no CUDA here
        assert row["process_peak_rss_bytes"] > 0 and row["visual_tokens"] > FULL_FRAME_CAP
        protected = row["prompt_tokens"] - row["visual_tokens"] + 3
        assert 0 < row["cache_peak_bytes"] <= (48 + 32 + protected) * entry  # M + b: bounded over 520 frames
        assert row["prefill_attention"] == "gqa"  # its blocks after the cache: grouped-query SDPA on this CPU
        assert f"| {method} | {row['ttft_seconds']:.2f} (gqa) | {row['ttft_seconds_per_hour']:,.0f} |" in table


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


@pytest.mark.parametrize("warmup", [True, False])
def test_every_case_is_warmed_up_once_before_the_measured_ones(warmup, monkeypatch, tmp_path):
    """The first CUDA call of each path pays one-off costs: every case runs once, untimed, on a small image and
    a short video first (two new tokens), so no measured row carries them; `--no-warmup` skips that."""
    from visualkv.bench import gpu

    calls = []  # (case label, media kind, frame size, new tokens) of every run
    original = gpu.run_case

    def spy(adapter, media, case, cfg):
        calls.append((case.label, media.kind, media.frames[0].shape[:2], cfg.new_tokens))
        return original(adapter, media, case, cfg)

    monkeypatch.setattr(gpu, "run_case", spy)
    cfg = GpuBenchConfig(
        model="tiny-qwen2.5-vl",
        device="cpu",
        methods=("blockwise-keydiff",),
        budget=48,
        image_size=(3000, 1400),  # larger than the warm-up's cap: the warm-up image is smaller
        video_seconds=3,
        video_size=(320, 240),
        new_tokens=3,
        out=str(tmp_path),
        video_dir=str(tmp_path),
        warmup=warmup,
    )
    res = run_gpu_bench(cfg, log=lambda line: None)
    labels = [REFERENCE, "blockwise-keydiff"]
    measured = [
        (label, kind, size, 3) for kind, size in (("image", (1400, 3000)), ("video", (240, 320))) for label in labels
    ]
    warm = [
        (label, kind, size, 2) for kind, size in (("image", (756, 1344)), ("video", (240, 320))) for label in labels
    ]
    assert calls == (warm + measured if warmup else measured)
    assert ("warmup_seconds" in res) == warmup and all("error" not in c for c in res["cases"])
