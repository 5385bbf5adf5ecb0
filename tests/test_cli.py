"""The CLI: answers, the JSON report, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.test_media import _make_bad_input
from visualkv.cli.main import main


@pytest.fixture(scope="module")
def image_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "img.png"
    from visualkv.bench.synthetic import synthetic_image

    Image.fromarray(synthetic_image(448, 336)).save(path)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _assert_one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]


@pytest.mark.parametrize(
    "kind, words",
    [
        ("corrupt_png", ["corrupt"]),
        ("empty", ["empty"]),
        ("text", ["not a video or image"]),
        ("tiny", ["1x1"]),
        ("huge", ["20000x20000", "downscale"]),
        ("undecodable_video", ["no decodable frame"]),
        ("pdf", ["pdf"]),
        ("thin", ["strip.png", "aspect ratio of 300:1", "crop"]),
        ("nan_tiff", ["measured.tif", "nan"]),
    ],
)
def test_bad_media_exits_2_with_one_line(tmp_path, capsys, kind, words):
    path = _make_bad_input(kind, tmp_path)
    code, _, err = _run(capsys, "run", "--media", str(path), "--prompt", "hi", "--quiet")
    _assert_one_line_error(code, err, *words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--prompt", "  "], ["empty"]),
        (["--prompt", "hi", "--method", "blockwise-snapkv", "--budget", "0"], ["budget", "positive"]),
        (["--prompt", "hi", "--method", "blockwise-snapkv", "--budget", "-5"], ["budget", "positive"]),
        (["--prompt", "hi", "--method", "blockwise-keydiff"], ["needs a budget", "--budget"]),
        (["--prompt", "hi", "--method", "blockwise-snapkv", "--keep", "0"], ["--keep", "(0, 1]"]),
        (["--prompt", "hi", "--method", "blockwise-snapkv", "--keep", "1.5"], ["--keep", "(0, 1]"]),
        (["--prompt", "hi", "--method", "blockwise-snapkv", "--keep", "0.1", "--budget", "8"], ["--keep", "--budget"]),
        (["--prompt", "hi", "--model", "no-such-org/no-such-model-xyz"], ["cannot load model", "no-such-model-xyz"]),
        (["--prompt", "hi", "--model", "./missing/folder"], ["does not exist"]),
        (["--prompt", "hi", "--method", "magic"], ["invalid choice"]),
        (["--prompt", "hi", "--decode", "graph"], ["decode 'graph' is not possible", "CUDA", "static"]),
        (["--prompt", "hi", "--vision-ahead", "0"], ["--vision-ahead", "positive"]),
        (["--prompt", "hi", "--decode-attention", "flash"], ["--decode-attention", "invalid choice", "grouped"]),
        (["--prompt", "hi", "--media", ""], ["--media", "empty"]),  # answered from the text alone before
        (["--prompt", "hi", "--fps", "inf"], ["--fps", "finite", "inf"]),
        (["--prompt", "hi", "--fps", "nan"], ["--fps", "nan"]),
    ],
)
def test_bad_options_exit_2_with_one_line(image_file, capsys, args, words):
    code, _, err = _run(capsys, "run", "--media", str(image_file), "--quiet", *args)
    _assert_one_line_error(code, err, *words)


@pytest.mark.parametrize(
    "where, words",
    [
        ("missing/report.json", ["folder", "does not exist"]),
        (".", ["is a folder", "give a file name"]),
        ("a_file/report.json", ["is a file, not a folder"]),
        ("/proc/visualkv-report.json", ["cannot write"]),  # refused even to root (CI runs as root)
    ],
)
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(
    image_file, tmp_path, capsys, monkeypatch, where, words
):
    """The report is written at the end: a bad --json must fail before minutes of work, not after them."""
    from visualkv.models import registry

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model was loaded although --json could not be written")

    monkeypatch.setattr(registry, "load_model", no_load)
    (tmp_path / "a_file").write_text("not a folder")
    path = where if where.startswith("/") else str(tmp_path / where)
    code, _, err = _run(capsys, "run", "--media", str(image_file), "--prompt", "hi", "--json", path)
    _assert_one_line_error(code, err, "--json", *words)


def test_a_json_path_check_leaves_no_file_and_spares_an_existing_one(tmp_path):
    from visualkv.cli.args import output_file

    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text('{"kept": true}')
    assert output_file(str(new)) == str(new) and not new.exists()  # checked by creating it, then removed
    assert output_file(str(old)) == str(old) and old.read_text() == '{"kept": true}'  # not truncated


@pytest.mark.parametrize("argv", [["bench", "latency", "--out", "{file}"], ["bench", "one", "--json", "{missing}"]])
def test_bench_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path, capsys, argv):
    (tmp_path / "a_file").write_text("")
    names = {"file": str(tmp_path / "a_file"), "missing": str(tmp_path / "no" / "r.json")}
    code, _, err = _run(capsys, *[a.format(**names) for a in argv], "--model", "tiny-qwen2.5-vl")
    _assert_one_line_error(code, err, "a_file" if "--out" in argv else "does not exist")


def test_cuda_without_a_gpu_exits_2_with_one_line(image_file, capsys, monkeypatch):
    """--device cuda where PyTorch sees no GPU: one line naming the fix, not the driver's traceback."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = _run(capsys, "run", "--media", str(image_file), "--quiet", "--prompt", "hi", "--device", "cuda")
    _assert_one_line_error(code, err, "no CUDA GPU", "device cpu or auto")


def test_a_gpu_index_past_the_last_is_refused(monkeypatch):
    import torch

    from visualkv.errors import ModelLoadError
    from visualkv.models.registry import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")  # the last one is fine
    with pytest.raises(ModelLoadError, match=r"sees 2 GPU\(s\) \(cuda:0 to cuda:1\)"):
        check_device("cuda:2")


def test_keep_sets_the_budget_from_the_media_s_visual_tokens(image_file, tmp_path, capsys):
    """--keep 0.1: the budget is a tenth of the visual tokens, known only once the media is read; the report says
    the figure and the share, and the cache holds less than the full one."""
    out = tmp_path / "report.json"
    argv = ["run", "--media", str(image_file), "--prompt", "What is this?", "--method", "blockwise-snapkv"]
    code, _, err = _run(capsys, *argv, "--keep", "0.1", "--max-new-tokens", "2", "--quiet", "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["keep"] == 0.1 and report["visual_tokens"] > 20
    assert report["budget"] == round(report["visual_tokens"] / 10)
    assert report["peak_kv_bytes"] < report["full_kv_bytes"]


def test_run_two_turns_writes_report(image_file, tmp_path, capsys):
    out = tmp_path / "report.json"
    code, stdout, err = _run(
        capsys,
        "run",
        "--media",
        str(image_file),
        "--prompt",
        "What is this?",
        "--prompt",
        "And then?",
        "--method",
        "blockwise-snapkv",
        "--budget",
        "32",
        "--block-size",
        "64",
        "--max-new-tokens",
        "4",
        "--decode",
        "static",
        "--decode-attention",
        "grouped",
        "--json",
        str(out),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    assert [t["decode_attention"] for t in report["turns"]] == ["grouped", "grouped"]
    assert err.count(" tok/s (static, grouped)") == 2
    for key in (
        "model",
        "method",
        "budget",
        "visual_tokens",
        "peak_kv_bytes",
        "full_kv_bytes",
        "final_kv_bytes",
        "peak_rss_bytes",
        "blocks",
        "turns",
        "retained",
    ):
        assert key in report
    assert report["method"] == "blockwise-snapkv" and report["budget"] == 32
    assert len(report["turns"]) == 2 and all("ttft_seconds" in t and "token_ids" in t for t in report["turns"])
    for block in report["blocks"]:
        assert {"index", "kind", "tokens_in", "kv_tokens", "kv_bytes", "rss_bytes", "seconds"} <= set(block)
    assert len(report["retained"]) == report["visual_tokens"]
    assert report["final_kv_bytes"] < report["full_kv_bytes"]
    assert len(stdout.strip().splitlines()) == 2  # one answer per turn on stdout
    assert "block 1/" in err  # progress per block on stderr


def test_video_report_has_frames(tmp_path, capsys):
    from tests.test_media import noise_frames, write_video

    path = write_video(tmp_path / "clip.avi", noise_frames(6), fourcc="MJPG")
    out = tmp_path / "r.json"
    code, _, err = _run(
        capsys,
        "run",
        "--media",
        str(path),
        "--prompt",
        "What happens?",
        "--fps",
        "4",
        "--max-new-tokens",
        "2",
        "--quiet",
        "--json",
        str(out),
        "--model",
        "tiny-smolvlm2",
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["frames"] and {"index", "time", "skipped"} <= set(report["frames"][0])


@pytest.mark.parametrize("kind, words", [("empty", "empty"), ("undecodable_video", "no decodable frame")])
def test_subprocess_entry_point_no_traceback(tmp_path, kind, words):
    """The real `python -m visualkv` process: exit code 2, one line, for a zero-byte file; and for a broken video,
    whose decoders (FFmpeg in decord and in OpenCV) print their own lines unless silenced."""
    path = _make_bad_input(kind, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "visualkv", "run", "--media", str(path), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr, proc.stderr


def test_models_lists_aliases(capsys):
    code, out, _ = _run(capsys, "models")
    assert code == 0 and "tiny-qwen2.5-vl" in out and "Qwen/Qwen2.5-VL-3B-Instruct" in out


def test_run_defaults_to_the_demo_model(tmp_path, capsys):
    """No --model: the bundled demo model, which answers its own example scene."""
    from visualkv.bench.demo_examples import load_demo_examples

    example = next(e for e in load_demo_examples() if e.kind == "image")
    question = example.featured()[0]
    code, out, err = _run(
        capsys,
        "run",
        "--media",
        example.path,
        "--prompt",
        question.question,
        "--quiet",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["model"] == "visualkv-demo"
    assert out.strip() == question.answer


def test_block_progress_says_how_far_into_the_video(tmp_path, capsys):
    """Each block's progress line on stderr says how far into a video the prefill has read (as the app does)."""
    from tests.test_media import noise_frames, write_video

    path = write_video(tmp_path / "clip.avi", noise_frames(40, 112, 84), fps=1.0, fourcc="MJPG")
    # fmt: off
    code, _, err = _run(
        capsys, "run", "--media", str(path), "--prompt", "What happens?", "--fps", "1", "--max-new-tokens", "1",
        "--model", "tiny-qwen2.5-vl", "--method", "blockwise-keydiff", "--budget", "32", "--block-size", "40",
        "--prefill", "blockwise",
    )
    # fmt: on
    assert code == 0, err
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith("block ")]
    frames = [re.search(r" frame .* video (\d+):(\d\d) of 0:40 read$", line) for line in lines if " frame " in line]
    assert len(frames) >= 3 and all(frames), lines
    seconds = [int(m[1]) * 60 + int(m[2]) for m in frames]
    assert seconds == sorted(seconds) and seconds[0] < 10 and seconds[-1] >= 38, seconds
    assert "video" not in lines[0]  # the text before the video has read none of it


def test_media_warnings_reach_stderr_and_the_report(tmp_path, capsys):
    """A frame that cannot be decoded (found during the prefill) and an animated image's unread frames are told
    on stderr (at load) and kept in the report's media.warnings (everything found by the end of the turn)."""
    from tests.test_media import corrupt_mjpeg, noise_frames, write_video

    video = corrupt_mjpeg(write_video(tmp_path / "clip.avi", noise_frames(6), fourcc="MJPG"), frames=[3])
    out = tmp_path / "video.json"
    argv = ["run", "--prompt", "What happens?", "--max-new-tokens", "2", "--quiet", "--model", "tiny-smolvlm2"]
    code, _, err = _run(capsys, *argv, "--media", str(video), "--fps", "4", "--json", str(out))
    assert code == 0, err
    stood_in = "frame 3 (t=0.75 s) could not be decoded; frame 2 (t=0.50 s) shown in its place"
    assert json.loads(out.read_text())["media"]["warnings"] == [stood_in]
    first, second = (Image.new("RGB", (64, 64), colour) for colour in ("blue", "green"))
    first.save(tmp_path / "anim.gif", save_all=True, append_images=[second], duration=100)
    code, _, err = _run(capsys, *argv, "--media", str(tmp_path / "anim.gif"), "--json", str(out))
    assert code == 0, err
    assert "warning: '" in err and "anim.gif' is an animated GIF (2 frames): only the first frame is read" in err
    report_warnings = json.loads(out.read_text())["media"]["warnings"]
    assert len(report_warnings) == 1 and report_warnings[0].startswith("'anim.gif' is an animated GIF")
    assert str(tmp_path) not in out.read_text()  # the server's folders stay out of the report


def test_every_command_line_option_is_in_the_cli_reference():
    """Every option of `python -m visualkv run|models|bench` is named in docs/CLI.md (where it says what it does)."""
    import argparse

    from visualkv.cli.main import build_parser

    reference = (Path(__file__).resolve().parent.parent / "docs" / "CLI.md").read_text()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [
        f"{name} {option}"
        for name, parser in commands.items()
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help" and not re.search(re.escape(option) + r"(?![\w-])", reference)
    ]
    assert missing == []


def test_run_evidence_prints_recall_for_every_method(image_file, tmp_path, capsys):
    """`run --evidence` prints each turn's evidence recall and the summary's, and writes it in the report."""
    for method, budget in (("full", None), ("blockwise-keydiff", "16"), ("blockwise-random", "16")):
        out = tmp_path / f"{method}.json"
        argv = ["run", "--model", "tiny-qwen2.5-vl", "--media", str(image_file), "--prompt", "What is this?"]
        argv += ["--method", method, "--max-new-tokens", "3", "--evidence", "--json", str(out)]
        argv += ["--budget", budget] if budget else []
        code, _, err = _run(capsys, *argv)
        assert code == 0, err
        report = json.loads(out.read_text())
        recall = report["evidence_recall"]
        assert f"  evidence recall {recall:.3f}" in err and f", evidence recall {recall:.3f}" in err
        assert (recall == 1.0) if method == "full" else (0 < recall < 1)
        assert report["evidence"]["map_shape"] == [2, report["visual_tokens"]]
