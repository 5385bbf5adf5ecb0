"""`python -m visualkv bench ...`: every kind runs end to end at toy sizes and writes its figures;
bad options fail at parse time with one line and exit code 2, before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_cli import _assert_one_line_error, _run

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "args, words",
    [
        (["needle", "--needle-sizes", "foo"], ["--needle-sizes", "WIDTHxHEIGHT"]),
        (["needle", "--needle-sizes", "672x378,100x100"], ["--needle-sizes", "100x100"]),
        (["needle", "--fractions", "10"], ["--fractions", "(0, 1]"]),
        (["needle", "--fractions", "0.1,0"], ["--fractions", "(0, 1]"]),
        (["needle", "--methods", "full,snapkv"], ["--methods", "unknown method", "snapkv"]),
        (["needle", "--scenes", "-1"], ["--scenes", "0 or more"]),
        (["needle", "--scenes", "0", "--scenes-large", "0", "--videos", "0"], ["nothing to run"]),
        (["memory", "--sizes", "1,big"], ["--sizes", "big"]),
        (["latency", "--budget", "-5"], ["--budget", "positive"]),
        (["latency", "--repeats", "0"], ["--repeats", "positive"]),
        (["latency", "--device", "tpu"], ["--device", "invalid choice"]),
        (["one", "--method", "magic"], ["--method", "invalid choice"]),
        (["fidelity", "--dtype", "int3"], ["--dtype", "invalid choice"]),
    ],
)
def test_bad_bench_options_exit_2_with_one_line(tmp_path, capsys, args, words):
    code, _, err = _run(capsys, "bench", *args, "--out", str(tmp_path))
    _assert_one_line_error(code, err, *words)
    assert not any(tmp_path.iterdir())  # refused before any work


def test_needle_defaults_keep_4k_to_one_budget():
    """With no options, 4K scenes (seconds per case) run at the one large budget, the others at three."""
    from visualkv.cli.main import build_parser

    args = build_parser().parse_args(["bench", "needle"])
    assert args.needle_sizes == [(560, 315), (672, 378), (3840, 2160)]
    assert args.fractions == [0.05, 0.1, 0.25] and args.large_fractions == [0.1]


def test_needle_bench_writes_the_results_contract(tmp_path, capsys):
    """The needle JSON contract: a `results` list of {method, budget_fraction, setting, size, accuracy}."""
    out = tmp_path / "needle.json"
    code, stdout, err = _run(
        capsys,
        "bench",
        "needle",
        "--needle-sizes",
        "256x256",
        "--scenes",
        "2",
        "--videos",
        "1",
        "--methods",
        "full,blockwise-keydiff",
        "--fractions",
        "0.25",
        "--json",
        str(out),
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    data = json.loads(out.read_text())
    _assert_provenance(data, "bench needle --needle-sizes 256x256")
    assert data["model"] == "visualkv-demo"  # the default for needle: random weights cannot answer
    rows = data["results"]
    assert {(r["method"], r["setting"]) for r in rows if r["size"] == "256x256"} == {
        (m, s) for m in ("full", "blockwise-keydiff") for s in ("single", "followup")
    }
    for r in rows:
        assert set(r) >= {"method", "budget_fraction", "setting", "size", "accuracy"}
        assert 0 <= r["accuracy"] <= 1
        assert r["budget_fraction"] == (1.0 if r["method"] == "full" else 0.25)
    assert any(r["size"].startswith("video") for r in rows)
    kept = {r["method"]: r["kept_fraction"] for r in rows if r["size"] == "256x256"}
    assert kept["full"] == 1.0 and kept["blockwise-keydiff"] <= 0.3  # the budget really evicted
    assert (tmp_path / "needle.html").is_file()
    assert "blockwise-keydiff" in stdout


def _assert_provenance(data: dict, command_part: str) -> None:
    """Every bench JSON says which command and machine produced it (README captions read this)."""
    prov = data["provenance"]
    assert command_part in prov["command"] and prov["command"].startswith("python -m visualkv bench")
    assert prov["cpu_cores"] >= 1 and prov["condition"] in ("idle", "loaded", "unknown")
    assert prov["load_end"] is None or prov["load_end"] >= 0


def test_memory_bench_full_against_blockwise(tmp_path, capsys):
    """Each (method, size) in a fresh process; block-wise holds less KV than full on the same input."""
    code, _, err = _run(
        capsys,
        "bench",
        "memory",
        "--sizes",
        "0.4",
        "--methods",
        "full,blockwise-snapkv",
        "--budget",
        "64",
        "--block-size",
        "64",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    data = json.loads((tmp_path / "memory_image_tiny-qwen2.5-vl.json").read_text())
    _assert_provenance(data, "bench memory --sizes 0.4")
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["full"]["visual_tokens"] == rows["blockwise-snapkv"]["visual_tokens"] > 64 + 64
    assert rows["blockwise-snapkv"]["peak_kv_bytes"] < rows["full"]["peak_kv_bytes"]
    assert rows["blockwise-snapkv"]["peak_kv_bytes"] <= rows["blockwise-snapkv"]["bound_kv_bytes"]
    assert data["summary"]["blockwise-snapkv"]["full_over_final_kv_largest"] > 1
    assert (tmp_path / "memory_image_tiny-qwen2.5-vl.html").is_file()


def test_latency_bench_reports_every_configuration(tmp_path, capsys):
    code, _, err = _run(
        capsys,
        "bench",
        "latency",
        "--size",
        "0.3",
        "--budget",
        "64",
        "--methods",
        "blockwise-snapkv,lightkv",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    data = json.loads((tmp_path / "latency_image_tiny-qwen2.5-vl.json").read_text())
    _assert_provenance(data, "bench latency --size 0.3")
    assert set(data["ttft_seconds"]) == {"full", "blockwise", "hybrid", "lightkv"}
    assert all(t > 0 for t in data["ttft_seconds"].values())
    assert data["final_kv_bytes"]["blockwise"] < data["final_kv_bytes"]["full"]
    assert 0 < data["kv_ratios"]["lightkv/full"] < 1


def test_fidelity_bench_with_nothing_evicted(tmp_path, capsys):
    code, _, err = _run(
        capsys, "bench", "fidelity", "--size", "0.1", "--methods", "blockwise-snapkv", "--out", str(tmp_path)
    )
    assert code == 0, err
    (row,) = json.loads((tmp_path / "fidelity_image_tiny-qwen2.5-vl.json").read_text())["rows"]
    assert row["method"] == "blockwise-snapkv" and row["blocks"] > 1
    assert row["cosine"] > 0.99 and row["same_top1"]


def test_salicache_bench_on_the_example_video(tmp_path, capsys):
    code, _, err = _run(
        capsys,
        "bench",
        "salicache",
        "--media",
        str(REPO / "assets" / "example_video.webm"),
        "--max-frames",
        "8",
        "--max-new-tokens",
        "2",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    data = json.loads((tmp_path / "salicache_tiny-qwen2.5-vl.json").read_text())
    tiers = data["tier_fractions"]
    assert sum(tiers.values()) == pytest.approx(1.0)
    assert data["kv_ratio_full_over_salicache"] > 1


def test_op_counter_tells_kernels_from_views_and_counts_host_reads():
    """The launch counters behind scripts/prefill_launches.py and scripts/vision_launches.py."""
    import torch

    from visualkv.bench.launches import HostReads, OpCounter

    x = torch.randn(4, 6)
    counter, reads = OpCounter(), HostReads()
    with counter, reads:
        y = x.view(6, 4).t()[1:]  # three views: dispatched, no kernel
        z = (y + 1).clone()  # two kernels
        q = torch.randn(1, 2, 8, 16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        int(z.sum())  # one host read
    assert counter.ops >= 6 and counter.attention == 1
    assert counter.kernels <= counter.ops - 3 and counter.kernels >= 3
    assert reads.reads == 1
    # kernels inside a named module's forward count under its part, the rest under "rest"
    inner = torch.nn.Linear(6, 6)
    counter = OpCounter()
    with counter.count_inside([inner], "inner"), counter:
        out = inner(x)  # one addmm
        x + 1  # one add
    assert counter.kernels_by_part == {"inner": 1, "rest": 1}
    assert torch.equal(out, inner(x))  # counting leaves the module's output alone
    inner(x)  # the hooks are gone after the block
    assert not inner._forward_hooks and not inner._forward_pre_hooks


def test_op_counter_counts_the_bytes_kernels_read_and_write():
    """bytes_moved: inputs and outputs of kernel-launching ops, a broadcast operand counted once, views free."""
    import torch

    from visualkv.bench.launches import OpCounter

    a, row = torch.zeros(100, 8), torch.zeros(1, 8, dtype=torch.float64)
    counter = OpCounter()
    with counter:
        a.view(8, 100).t()  # views: nothing moved
        assert counter.bytes_moved == 0
        a.expand(3, 100, 8) + 1  # reads 100 x 8 floats once (broadcast), writes 3 x 100 x 8
        assert counter.bytes_moved == 100 * 8 * 4 + 3 * 100 * 8 * 4
        before = counter.bytes_moved
        a.to(torch.float64) + row  # a float64 copy of a (reads 3,200, writes 6,400), then the add
        assert counter.bytes_moved - before == (3_200 + 6_400) + (6_400 + 64 + 6_400)
        before = counter.bytes_moved
        torch.empty(100, 8).copy_(a)  # allocating moves nothing; the copy reads a and writes its target once
        assert counter.bytes_moved - before == 3_200 + 3_200
        before = counter.bytes_moved
        torch.add(a, a, out=torch.empty(100, 8))  # reads a twice, writes `out` once
    assert counter.bytes_moved - before == 3 * 3_200
