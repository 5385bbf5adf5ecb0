"""The GPU targets judged on `bench gpu` rows (visualkv.bench.gpu_targets): against the better generate row,
with the repeats deciding met / within noise / not met; and the variant cases (`--forced-blockwise`,
`--vision-ahead`, `--decode-attention-rows`)."""

from __future__ import annotations

import pytest

from visualkv.bench import gpu_targets
from visualkv.bench.gpu import GENERATE, GENERATE_STATIC, GpuBenchConfig, cases, markdown_table, run_gpu_bench
from visualkv.bench.gpu_targets import MET, NOISE, NOT_MEASURED, NOT_MET, UNFAIR, case_label

GIB = 2**30
FAIR = {"sdpa_backends": ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"], "repeats": 3}


def _spread(value, spread):
    """A repeats figure: median `value`, min and max `spread` either side (None: not measured)."""
    if value is None:
        return None
    return {"median": value, "min": value - spread, "max": value + spread, "n": 3}


def _row(method, input="image", ttft=1.0, decode=40.0, peak=1000 * 2**20, spread=0.0, **extra):
    row = {"input": input, "method": method, "ttft_seconds": _spread(ttft, spread * ttft)}
    row["decode_tokens_per_second"] = _spread(decode, spread * decode)
    row.update(peak_over_weights_bytes=_spread(peak, 0), cache_peak_bytes=1, **extra)
    if input == "video":
        row.setdefault("video_kind", "mix")
        row.setdefault("video_seconds", 512)
    return row


def _result(rows, machine="NVIDIA H200 (139 GiB), 1 GPU(s)", config=FAIR):
    """Rows with their ratios to the references as `bench gpu` adds them."""
    from visualkv.bench.gpu import _add_ratios

    for label in dict.fromkeys(gpu_targets.input_label(r) for r in rows):
        _add_ratios([r for r in rows if gpu_targets.input_label(r) == label])
    return {"machine": machine, "weights_bytes": 16 * GIB, "config": config, "cases": rows}


def _verdicts(result, target_part, case=None, input=None):
    return [
        v
        for v in gpu_targets.evaluate(result)
        if target_part in v.target and (case is None or v.case == case) and (input is None or v.input == input)
    ]


def test_block_wise_ttft_is_judged_against_the_better_generate_on_both_plans():
    rows = [
        _row(GENERATE, ttft=3.0),
        _row(GENERATE_STATIC, ttft=2.0),  # the better reference: every ratio divides by it
        _row("full", ttft=1.5),
        _row("blockwise-keydiff", ttft=2.18),  # 1.09x
        _row("blockwise-keydiff", ttft=2.22, case="blockwise-keydiff (blockwise forced)", forced_prefill="blockwise"),
    ]
    by_case = {v.case: v for v in _verdicts(_result(rows), "block-wise TTFT")}
    assert by_case["blockwise-keydiff"].verdict == MET and by_case["blockwise-keydiff"].measured == pytest.approx(1.09)
    assert by_case["blockwise-keydiff (blockwise forced)"].verdict == NOT_MET  # 1.11x
    assert by_case["blockwise-snapkv (not run)"].verdict == NOT_MEASURED  # not measured, never met
    (peak,) = _verdicts(_result(rows), "peak <= 1/5", case="blockwise-snapkv (not run)")
    assert peak.verdict == NOT_MEASURED and peak.measured is None


def test_met_needs_the_worst_repeat_to_beat_the_references_best():
    """Medians 1.05x (under 1.10x); with 10 % spread the worst repeat is 1.155 / 0.9: within noise, not met."""
    rows = [_row(GENERATE, ttft=2.0, spread=0.1), _row(GENERATE_STATIC, ttft=2.5), _row("full")]
    rows += [_row("blockwise-keydiff", ttft=2.1, spread=0.1), _row("blockwise-snapkv", ttft=2.1)]
    rows += [_row("lightkv", ttft=2.6, spread=0.01)]
    verdicts = {v.case: v for v in _verdicts(_result(rows), "TTFT")}
    noisy = verdicts["blockwise-keydiff"]
    assert noisy.verdict == NOISE and noisy.measured == pytest.approx(1.05)
    assert noisy.worst == pytest.approx(2.31 / 1.8)  # its slowest repeat over generate's fastest
    assert verdicts["blockwise-snapkv"].verdict == NOISE  # exact itself, but the reference's best repeat is 1.8 s
    assert verdicts["lightkv"].verdict == NOT_MET  # 1.3x by the medians


def test_decode_higher_is_better_worst_case_is_min_over_max():
    rows = [_row(GENERATE, decode=40.0, spread=0.05), _row(GENERATE_STATIC, decode=30.0), _row("full", decode=90.0)]
    rows += [_row("blockwise-keydiff", decode=100.0, spread=0.2)]  # 2.5x by medians; 80 / 42 = 1.90x worst
    rows += [_row("salicache", decode=100.0)]  # 100 / 42 = 2.38x worst
    verdicts = {v.case: v for v in _verdicts(_result(rows), "2x the better generate")}
    assert verdicts["blockwise-keydiff"].verdict == NOISE and verdicts["blockwise-keydiff"].worst == pytest.approx(
        80 / 42
    )
    assert verdicts["salicache"].verdict == MET


def test_memory_targets_read_the_cuda_peak_and_are_not_measured_without_it():
    rows = [
        _row(GENERATE, peak=2000),
        _row("full", peak=1000),
        _row("blockwise-keydiff", peak=199),
        _row("blockwise-snapkv", peak=201),
    ]
    (kd,) = _verdicts(_result(rows), "peak <= 1/5", case="blockwise-keydiff")
    (snap,) = _verdicts(_result(rows), "peak <= 1/5", case="blockwise-snapkv")
    assert (kd.verdict, snap.verdict) == (MET, NOT_MET) and kd.measured == pytest.approx(0.199)
    on_cpu = [_row(m, peak=None) for m in (GENERATE, "full", "blockwise-keydiff")]
    assert all(v.verdict == NOT_MEASURED for v in _verdicts(_result(on_cpu, "CPU only (2 cores)"), "peak"))


def test_long_video_memory_limit_is_one_fiftieth():
    rows = [_row(m, input="video", peak=p) for m, p in ((GENERATE, 5000), ("full", 5000), ("blockwise-keydiff", 120))]
    (v,) = _verdicts(_result(rows), "peak <= 1/50", case="blockwise-keydiff")
    assert v.limit == pytest.approx(1 / 50) and v.verdict == NOT_MET  # 0.024 > 0.02


def test_decode_targets_against_the_better_generate_and_full():
    rows = [
        _row(GENERATE, decode=40.0),
        _row(GENERATE_STATIC, decode=20.0),
        _row("full", decode=90.0),
        _row("blockwise-keydiff", decode=85.0),  # 2.1x generate, below full
        _row("lightkv", decode=79.0),  # 1.98x generate
    ]
    result = _result(rows)
    gen = {v.case: v.verdict for v in _verdicts(result, "2x the better generate")}
    vs_full = {v.case: v.verdict for v in _verdicts(result, "full's") if "decode" in v.target}
    assert gen == {"blockwise-keydiff": MET, "lightkv": NOT_MET}
    assert vs_full == {"blockwise-keydiff": NOT_MET, "lightkv": NOT_MET}
    assert not {"full", GENERATE, GENERATE_STATIC} & set(gen)  # the references compress nothing


def test_a_file_without_fair_reference_rows_judges_no_time_against_generate():
    """The one-run files before the fair rows (generate not warmed per shape, backend not pinned): memory and
    `full` targets stand, time against generate is not judged."""
    rows = [_row("transformers-generate", ttft=2.0, decode=10.0), _row("full", decode=70.0, peak=1000)]
    rows += [_row("blockwise-keydiff", ttft=2.5, decode=100.0, peak=150)]
    result = _result(rows, config={"repeats": None})
    verdicts = {v.target: v.verdict for v in gpu_targets.evaluate(result) if v.case == "blockwise-keydiff"}
    assert verdicts["block-wise TTFT <= 1.10x the better generate"] == UNFAIR
    assert verdicts["decode tok/s >= 2x the better generate"] == UNFAIR
    assert verdicts["decode tok/s >= full's"] == MET and verdicts["block-wise CUDA peak <= 1/5 of full's"] == MET
    assert "No fair reference" in gpu_targets.markdown(result)
    assert "No fair reference" not in gpu_targets.markdown(_result(rows))


def test_salicache_limits_follow_the_video_kind_and_lightkv_is_judged_at_4k():
    rows = [_row(GENERATE, input="video", video_kind=k, ttft=10.0) for k in ("mix", "moving")]
    rows += [_row("full", input="video", video_kind=k, ttft=10.0) for k in ("mix", "moving")]
    rows += [_row("salicache", input="video", video_kind=k, ttft=12.0) for k in ("mix", "moving")]
    rows += [_row(GENERATE, ttft=2.0), _row("lightkv", ttft=1.4)]
    result = _result(rows)
    ttft = {v.input: (v.limit, v.verdict) for v in _verdicts(result, "Sali-Cache TTFT")}
    assert ttft == {"video mix, 512 s": (1.0, NOT_MET), "video moving, 512 s": (1.25, MET)}
    (light,) = _verdicts(result, "LightKV")
    assert light.input == "image" and light.verdict == MET and light.measured == pytest.approx(0.7)


def test_an_hour_is_judged_on_its_memory_and_refused_rows_are_not_measured():
    hour = {"input": "video", "video_seconds": 3600}
    rows = [
        {"input": "video", "method": GENERATE, "video_kind": "mix", "video_seconds": 3600, "refused": "cap"},
        _row("blockwise-keydiff", peak=int(0.8 * GIB), ttft_seconds_per_hour=_spread(180.0, 5), **hour),
        _row("blockwise-keydiff+salicache", peak=int(1.2 * GIB), ttft_seconds_per_hour=120.0, **hour),
    ]
    verdicts = gpu_targets.evaluate(_result(rows))
    assert {v.target for v in verdicts} == {
        "CUDA peak over weights <= 1 GiB on an hour",
        "TTFT per hour of video (recorded)",
    }
    peaks = {v.case: v.verdict for v in verdicts if "1 GiB" in v.target}
    assert peaks == {"blockwise-keydiff": MET, "blockwise-keydiff+salicache": NOT_MET}
    per_hour = {v.case: v.measured for v in verdicts if v.unit == "s/h"}
    assert per_hour == {"blockwise-keydiff": 180.0, "blockwise-keydiff+salicache": 120.0}  # medians; old files' numbers
    table = gpu_targets.markdown(_result(rows), verdicts)
    assert "| CUDA peak over weights ≤ 1 GiB on an hour | video mix, 3600 s | blockwise-keydiff | 0.80 GiB |" in table
    assert "**not met**" in table and "| issue |" not in table


def _tiny_image_bench(out, **overrides) -> GpuBenchConfig:
    """`bench gpu` on tiny-qwen2.5-vl, CPU, one small image, full and block-wise KeyDiff, 3 new tokens, one run
    per case (these tests check which rows run, not their figures)."""
    settings = {
        "model": "tiny-qwen2.5-vl",
        "device": "cpu",
        "methods": ("full", "blockwise-keydiff"),
        "budget": 48,
        "block_size": 32,
        "image_size": (448, 252),
        "new_tokens": 3,
        "inputs": ("image",),
        "out": str(out),
        "warmup": False,
        "repeats": 1,
    }
    return GpuBenchConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    cfg = _tiny_image_bench(tmp_path_factory.mktemp("bench_gpu_forced"), forced_blockwise=True)
    return cfg, run_gpu_bench(cfg, log=lambda line: None)


def test_forced_blockwise_adds_a_case_per_block_wise_method(forced):
    cfg, result = forced
    assert [c.label for c in cases(cfg)] == [
        GENERATE,
        GENERATE_STATIC,
        "full",
        "blockwise-keydiff",
        "blockwise-keydiff (blockwise forced)",
    ]
    default, forced_row = (r for r in result["cases"] if r["method"] == "blockwise-keydiff")
    assert "forced_prefill" not in default and default["prefill"] == "hybrid"
    assert forced_row["forced_prefill"] == "blockwise" and forced_row["prefill"] == "blockwise"
    assert all("error" not in r for r in result["cases"]), [r.get("error") for r in result["cases"]]
    judged = {v.case for v in gpu_targets.evaluate(result) if "block-wise TTFT" in v.target}
    assert {"blockwise-keydiff", "blockwise-keydiff (blockwise forced)"} <= judged


def test_vision_ahead_rows_get_the_ttft_verdict_only():
    ahead = {"case": "blockwise-keydiff (vision ahead 4)", "vision_ahead": 4}
    rows = [
        _row(GENERATE, ttft=2.0, decode=40.0),
        _row("full", ttft=1.5, decode=40.0),
        _row("blockwise-keydiff", ttft=2.4, decode=100.0),  # 1.20x
        _row("blockwise-keydiff", ttft=2.1, decode=10.0, **ahead),  # 1.05x; its slow decode is not judged
    ]
    result = _result(rows)
    by_case = {v.case: v for v in _verdicts(result, "block-wise TTFT")}
    assert by_case["blockwise-keydiff"].verdict == NOT_MET
    assert by_case["blockwise-keydiff (vision ahead 4)"].verdict == MET
    assert {v.case for v in _verdicts(result, "decode")} == {"blockwise-keydiff"}  # the default row's decode
    cases_judged = {v.case for v in _verdicts(result, "peak <= 1/5")}
    assert cases_judged == {"blockwise-keydiff", "blockwise-snapkv (not run)"}  # memory: the default row only


def test_vision_ahead_adds_a_case_per_block_wise_method(tmp_path):
    cfg = _tiny_image_bench(
        tmp_path,
        methods=("full", "blockwise-keydiff", "salicache"),
        block_size=64,
        image_size=(896, 504),
        vision_ahead=4,
    )
    labels = [c.label for c in cases(cfg)]
    assert labels == [GENERATE, GENERATE_STATIC, "full", "blockwise-keydiff", "blockwise-keydiff (vision ahead 4)"] + [
        "salicache"
    ]
    result = run_gpu_bench(cfg, log=lambda line: None)
    default, ahead = (r for r in result["cases"] if r["method"] == "blockwise-keydiff")
    assert "vision_ahead" not in default and ahead["vision_ahead"] == 4
    assert ahead["case"] == "blockwise-keydiff (vision ahead 4)"
    assert all("error" not in r for r in result["cases"]), [r.get("error") for r in result["cases"]]


def test_decode_attention_rows_run_each_method_with_the_attention_forced(tmp_path):
    """`--decode-attention-rows grouped`: a row per method beside its default, decoded with that attention, judged by
    no target (the default row is what a user runs)."""
    cfg = _tiny_image_bench(
        tmp_path,
        block_size=64,
        session_overrides={"decode": "static"},  # the graph's fixed-shape step, on CPU
        decode_attention_rows=("grouped",),
    )
    labels = [c.label for c in cases(cfg)]
    assert labels == [
        GENERATE,
        GENERATE_STATIC,
        "full",
        "full (decode attention grouped)",
        "blockwise-keydiff",
        "blockwise-keydiff (decode attention grouped)",
    ]
    result = run_gpu_bench(cfg, log=lambda line: None)
    assert all("error" not in r for r in result["cases"]), [r.get("error") for r in result["cases"]]
    rows = {case_label(r): r for r in result["cases"]}
    assert rows["full"]["decode_attention"] == "model" and "forced_decode_attention" not in rows["full"]
    forced_row = rows["full (decode attention grouped)"]
    assert forced_row["decode_attention"] == "grouped" and forced_row["forced_decode_attention"] == "grouped"
    judged = {v.case for v in gpu_targets.evaluate(result)}
    assert "blockwise-keydiff" in judged and not any("decode attention" in case for case in judged)
    assert "| full (decode attention grouped) |" in markdown_table(result)
