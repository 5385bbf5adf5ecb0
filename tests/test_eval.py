"""`python -m visualkv eval` on miniature copies of the four benchmarks (scripts/eval_miniatures.py).

The expectations come from the miniature files themselves (read here with pandas / json, not through the
readers) and from hand-written answers: the official extraction rules, the scoring, resumption after a
torn line, a 2-process torchrun equal to the 1-process run, and one-line errors for bad inputs.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from visualkv.cli.main import main
from visualkv.eval import hrbench, mlvu, ranks, videomme, vstar
from visualkv.eval.items import DataError, EvalItem

REPO = Path(__file__).resolve().parent.parent
METHODS = ["--methods", "full,blockwise-keydiff", "--budgets", "32"]  # V*Bench's runs; the others run `full` only
VIDEO = ["--fps", "4"]  # the miniature videos: 16 frames at 4 fps, every frame read
TIMING = ("ttft_seconds", "seconds")


def _cli(*argv: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    command = (launcher or [sys.executable]) + ["-m", "visualkv", "eval", *argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def minis(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("minis")
    subprocess.run(
        [sys.executable, "scripts/eval_miniatures.py", str(out), "--videos", "1", "--images", "1"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def _truth(name: str, data: Path) -> dict[str, tuple[list[str], str]]:
    """item id -> (option texts, right letter), read straight from the release files."""
    import pandas as pd

    if name == "videomme":
        frame = pd.read_parquet(next((data / "videomme").glob("test-*.parquet")))
        return {r.question_id: ([o[3:] for o in r.options], r.answer) for r in frame.itertuples()}
    if name == "mlvu":
        truth = {}
        for path in sorted((data / "json").glob("*.json")):
            for i, e in enumerate(json.loads(path.read_text())):
                truth[f"{e['question_type']}/{i}"] = (e["candidates"], "ABCD"[e["candidates"].index(e["answer"])])
        return truth
    if name == "vstar":
        truth = {}
        for r in _lines(data / "test_questions.jsonl"):
            options = [line[4:] for line in r["text"].splitlines() if line.startswith("(")]
            truth[str(r["question_id"])] = (options, r["label"])
        return truth
    truth = {}
    for res in ("4k", "8k"):
        for r in pd.read_parquet(data / f"hr_bench_{res}.parquet").itertuples():
            truth[f"{res}/{r.index}"] = ([r.A, r.B, r.C, r.D], r.answer)
    return truth


BENCHMARKS = ["videomme", "mlvu", "vstar", "hrbench"]
_RUNS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def runs(minis, tmp_path_factory):
    """Each miniature run once with the demo model (1 process), its out folder by benchmark."""

    def run(name: str) -> Path:
        if name not in _RUNS:
            out = tmp_path_factory.mktemp(f"run-{name}")
            methods = METHODS if name == "vstar" else ["--methods", "full"]
            _cli("--benchmark", name, "--data", str(minis / name), "--out", str(out), "--prompt", "question",
                 *methods, *VIDEO)  # fmt: skip
            _RUNS[name] = out
        return _RUNS[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_miniature_runs_and_is_scored(name, minis, runs):
    """Every item under each point; the extracted choice is the option the demo model named, correct when it is
    the release's answer; KV under the budget below full; the summary's accuracy is the benchmark's average."""
    out = runs(name)
    rows = _lines(out / "results.jsonl")
    truth = _truth(name, minis / name)
    assert sorted({r["item_id"] for r in rows}) == sorted(truth)
    points = [("full", None), ("blockwise-keydiff", 32)] if name == "vstar" else [("full", None)]
    assert sorted((r["method"], r["budget"]) for r in rows) == sorted(points * len(truth))
    for r in rows:
        options, right = truth[r["item_id"]]
        said = r["answer"].strip().lower()
        named = [letter for letter, text in zip("ABCD", options) if text.lower() == said]
        assert r["choice"] == (named[0] if named else None), r
        assert r["correct"] == (r["choice"] == right) and r["expected"] == right
        assert r["peak_kv_bytes"] >= r["final_kv_bytes"] > 0 and r["ttft_seconds"] > 0
    full = {r["item_id"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        if r["method"] != "full":
            assert r["final_kv_bytes"] < full[r["item_id"]]["final_kv_bytes"]
    summary = json.loads((out / "summary.json").read_text())
    for entry in summary["results"]:
        mine = [r for r in rows if r["method"] == entry["method"]]
        if name == "mlvu":  # M-avg: the mean of the two tasks' accuracies
            tasks = [[r["correct"] for r in mine if r["item_id"].startswith(t)] for t in ("needle", "order")]
            expected = (sum(tasks[0]) / len(tasks[0]) + sum(tasks[1]) / len(tasks[1])) / 2
        elif name == "hrbench":  # the mean over the two cycle categories
            cycles = [[r["correct"] for r in mine if int(r["item_id"].split("/")[1]) % 2 == c] for c in (0, 1)]
            expected = (sum(cycles[0]) / len(cycles[0]) + sum(cycles[1]) / len(cycles[1])) / 2
        else:
            expected = sum(r["correct"] for r in mine) / len(mine)
        assert entry["accuracy"] == pytest.approx(expected, abs=1e-4)
    assert (out / "accuracy_kv.html").is_file()


def test_official_extraction_rules():
    """Hand-written answers through each benchmark's official rule, then the option-text fallback."""
    colors = ["red", "blue", "green", "yellow"]
    item = EvalItem("x", "m.mp4", "p", colors, "D")
    assert videomme.official_choice("The best answer is C.") == "C"
    assert videomme.official_choice("(B) blue") == "B"
    assert videomme.extract("yellow", item) == "D"
    assert videomme.extract("pink", item) is None
    assert mlvu.official_choice("B) blue", "ABCD") == "B"
    assert mlvu.official_choice("blue", "ABCD") is None
    assert mlvu.extract("green", item) == "C"
    assert vstar.official_choice("The answer is C") == "C" and vstar.official_choice("(D)") == "D"
    assert vstar.extract("red", item) == "A"  # not "D", which upper-casing "RED" would give
    assert hrbench.extract("the answer is B", item) == "B"
    assert hrbench.extract("red or blue", item) is None
    assert vstar.split_text("What is it?\n(A) a cup\n(B) a mug\nAnswer with the option's letter.", Path("q"), "l") == (
        "What is it?",
        ["a cup", "a mug"],
    )


def test_official_prompts():
    assert videomme.INSTRUCTION == (
        "Select the best answer to the following multiple-choice question based on the video. "
        "Respond with only the letter (A, B, C, or D) of the correct option."
    )
    assert videomme.prompt("Q?", ["A. x", "B. y"]).splitlines() == [
        videomme.INSTRUCTION,
        "Q?",
        "A. x",
        "B. y",
        "The best answer is:",
    ]
    assert mlvu.prompt("Q?", ["x", "y"]).endswith(
        "Question: Q?\nOptions:\n(A) x\n(B) y\nOnly give the best option.\nBest option: ("
    )
    assert (
        vstar.prompt("Q?", ["x", "y"])
        == "Q?\nA. x\nB. y\nAnswer with the option's letter from the given choices directly."
    )
    assert hrbench.prompt(" Q? ", ["x", "y"]) == "Q?\nA. x\nB. y\nAnswer the option letter directly."


@pytest.mark.slow
def test_a_rerun_resumes_after_a_torn_line(minis, runs, tmp_path):
    """A crash mid-write (the last answer's line torn) costs only that answer: the rerun runs that one item again,
    skips the rest, and leaves no torn line behind."""
    import shutil

    out = tmp_path / "vstar"
    shutil.copytree(runs("vstar"), out)
    before = _untimed(_lines(out / "results.jsonl"))
    args = ("--benchmark", "vstar", "--data", str(minis / "vstar"), "--out", str(out), "--prompt", "question", *METHODS)
    shard = out / "shards" / "rank-0-of-1.jsonl"
    kept = shard.read_text().splitlines()[:-1]
    shard.write_text("\n".join(kept) + "\n" + '{"item_id": "1", "meth')  # the last answer lost mid-write
    (out / "results.jsonl").unlink()
    resumed = _cli(*args)
    assert "2 items in this shard, 1 to run" in resumed.stderr
    assert _untimed(_lines(out / "results.jsonl")) == before
    assert all(json.loads(line) for line in shard.read_text().splitlines())  # no torn line left behind


@pytest.mark.slow
def test_two_processes_equal_one(minis, runs, tmp_path):
    """torchrun --nproc-per-node 2 (gloo on CPU): disjoint shards, one file per rank, rank 0's merge equals the
    1-process run item by item."""
    out = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533"]
    _cli("--benchmark", "vstar", "--data", str(minis / "vstar"), "--out", str(out), "--prompt", "question", *METHODS,
         launcher=torchrun)  # fmt: skip
    shards = [_lines(out / "shards" / f"rank-{r}-of-2.jsonl") for r in (0, 1)]
    ids = [{row["item_id"] for row in s} for s in shards]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert _untimed(_lines(out / "results.jsonl")) == _untimed(_lines(runs("vstar") / "results.jsonl"))


def test_ranks_from_the_launchers_environment():
    rank = ranks.from_env({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    assert (rank.rank, rank.world, rank.local) == (2, 3, 0)
    assert ranks.from_env({}) == ranks.Rank(0, 1, 0)
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert ranks.from_env(mpi) == ranks.Rank(1, 2, 1)  # accelerate launch --cpu under mpirun
    items = list(range(10))
    shards = [ranks.Rank(r, 3, r).shard(items) for r in range(3)]
    assert sorted(i for shard in shards for i in shard) == items and all(shards)
    assert ranks.device_for(ranks.Rank(1, 2, 1), "cpu") == "cpu"


def _one_line_error(capsys, *argv: str, words: str) -> None:
    code = main(["eval", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def test_bad_inputs_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "out")
    _one_line_error(capsys, "--benchmark", "vstar", "--data", str(tmp_path / "nope"), "--out", out, words="nope")
    _one_line_error(capsys, "--benchmark", "mmbench", "--data", str(tmp_path), "--out", out, words="mmbench")
    _one_line_error(
        capsys, "--benchmark", "vstar", "--data", str(tmp_path), "--out", out, "--methods", "zip", words="zip"
    )
    (tmp_path / "videomme").mkdir()
    (tmp_path / "videomme" / "test-00000-of-00001.parquet").write_bytes(b"not parquet")
    _one_line_error(capsys, "--benchmark", "videomme", "--data", str(tmp_path), "--out", out, words="test-00000")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "2_needle.json").write_text('[{"video": "a.mp4", "question"')
    _one_line_error(capsys, "--benchmark", "mlvu", "--data", str(tmp_path), "--out", out, words="2_needle.json")
    (tmp_path / "HRBench4K.tsv").write_text("index\tquestion\n0\tWhat?\n")
    _one_line_error(capsys, "--benchmark", "hrbench", "--data", str(tmp_path), "--out", out, words="missing column")
    (tmp_path / "test_questions.jsonl").write_text(
        json.dumps({"image": "direct_attributes/a.jpg", "text": "Q?\n(A) x\n(B) y", "category": "c", "label": "A"})
    )
    _one_line_error(capsys, "--benchmark", "vstar", "--data", str(tmp_path), "--out", out, words="a.jpg")
    _one_line_error(
        capsys, "--benchmark", "vstar", "--data", str(tmp_path), "--out", out, "--methods", "blockwise-keydiff",
        words="--budgets",
    )  # fmt: skip


def test_hrbench_reads_vlmevalkit_tsv_with_base64_images(tmp_path):
    """The TSV copy (VLMEvalKit's name) reads like the parquet: options, answer, groups and the decoded image."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (255, 0, 0)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    header = "index\tquestion\tanswer\tcategory\tcycle_category\tA\tB\tC\tD\timage"
    (tmp_path / "HRBench8K.tsv").write_text(
        f"{header}\n7\tWhat colour?\tB\tsingle\t0\tblue\tred\tgreen\tpink\t{image}\n"
    )
    (item,) = hrbench.read(tmp_path, "8k")
    assert (item.item_id, item.options, item.answer, item.groups["category"]) == (
        "8k/7",
        ["blue", "red", "green", "pink"],
        "B",
        "single",
    )
    assert item.media().size == (8, 6)


def test_subset_and_limit_pick_items(minis):
    """--subset keeps one duration / task / category / resolution; --limit the first N of those."""
    from visualkv.eval.runner import EvalConfig, load_items

    def ids(name: str, subset: str | None, limit: int | None = None) -> list[str]:
        config = EvalConfig(name, minis / name, minis / "unused", subset=subset, limit=limit)
        return [i.item_id for i in load_items(config)]

    assert ids("videomme", "short") == ["001-1", "001-2"]
    with pytest.raises(DataError, match="no videomme questions in medium"):
        ids("videomme", "medium")
    assert ids("mlvu", "order") == ["order/0"] and ids("mlvu", None, limit=1) == ["needle/0"]
    assert ids("vstar", "relative_position") == ["1"]
    assert ids("hrbench", "8k") == ["8k/0", "8k/1"]
