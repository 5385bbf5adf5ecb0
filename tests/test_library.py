"""The Python library's front door: the README's example runs verbatim, and `import visualkv` stays light."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- library-example -->"


def readme_example() -> str:
    """The Python block right after the marker in README.md."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "README.md lost its library example marker"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.DOTALL)
    assert block is not None, "no ```python block after the library example marker"
    return block.group(1)


def ground_truth(file: str, question: str) -> str:
    """The answer the demo's scene generator recorded for `question` about `file`."""
    examples = json.loads((ROOT / "assets/visualkv-demo/examples.json").read_text())["examples"]
    (example,) = [e for e in examples if e["file"] == file]
    (answer,) = [q["answer"] for q in example["questions"] if q["question"] == question]
    return answer


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(not (ROOT / "assets/visualkv-demo/config.json").exists(), reason="bundled demo model absent")
def test_the_readme_library_example_runs_and_answers():
    done = _run(readme_example())
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    blocks = [re.match(r"block (\d+)/(\d+): \d+ KiB of KV held$", line) for line in lines]
    blocks = [(int(m[1]), int(m[2])) for m in blocks if m]
    assert blocks, done.stdout  # on_block was called
    total = blocks[0][1]
    assert total > 1 and blocks == [(i, total) for i in range(1, total + 1)], blocks  # one line per block
    answer = next(line for line in lines if line.startswith("answer: "))
    expected = ground_truth("example_scene.png", "Which quadrant holds the triangle?")
    assert answer.startswith(f"answer: {expected} (TTFT "), answer
    followup = lines[lines.index(answer) + 1]
    assert followup.strip() == ground_truth("example_scene.png", "What color is the triangle?"), followup
    share = re.search(r"(\d+) visual tokens, peak KV (\d+)% of full", done.stdout)
    assert share and int(share[1]) > 128 and int(share[2]) < 100, done.stdout  # the budget really bounded it
    video = next(line for line in lines if line.startswith("video answer: "))
    assert video == f"video answer: {ground_truth('example_needle_video.webm', 'What color was the ring?')}", video


def test_import_is_light_and_every_public_name_resolves():
    code = (
        "import sys, visualkv\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'import visualkv loaded torch'\n"
        "assert set(visualkv.__all__) == {'__version__', *visualkv._EXPORTS}, 'public names out of step'\n"
        "missing = [n for n in visualkv.__all__ if getattr(visualkv, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(visualkv.__all__) <= set(dir(visualkv))\n"
        "try:\n"
        "    visualkv.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')\n"
        "from visualkv import ChatSession, load_model\n"
        "from visualkv.runtime.session import ChatSession as defined\n"
        "assert ChatSession is defined and callable(load_model)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_turn_takes_a_path_a_pil_image_or_an_array_as_media(tmp_path, small_image):
    from PIL import Image

    from tests.conftest import get_adapter
    from visualkv import ChatSession, ConfigError, SessionConfig

    adapter = get_adapter("tiny-qwen2.5-vl")
    pixels = small_image.frames[0]
    path = tmp_path / "scene.png"
    Image.fromarray(pixels).save(path)
    config = SessionConfig(method="blockwise-keydiff", budget=32, block_size=64, max_new_tokens=4)
    turns = {}
    for name, media in {"Media": small_image, "str": str(path), "Path": path, "PIL": Image.fromarray(pixels)}.items():
        session = ChatSession(adapter, config)
        turns[name] = session.ask("what is here?", media)
        assert session.media is not None and session.media.kind == "image", name
        assert session.media.size == small_image.size, name
    session = ChatSession(adapter, config)
    turns["array"] = session.ask("what is here?", pixels)
    assert {name: t.token_ids for name, t in turns.items()} == {name: turns["Media"].token_ids for name in turns}
    with pytest.raises(ConfigError, match="media must be a file path, a PIL image, an RGB array"):
        ChatSession(adapter, config).ask("what is here?", b"\x89PNG")
