"""docs/ARCHITECTURE.md's "How to add a method" runs as written: its scorer file, saved verbatim, registers a method
that the registry, the CLI, the app's menu, Compare and the invariant suite on every family then take."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests import test_invariants as inv
from tests.conftest import get_adapter
from visualkv.bench.synthetic import image_media, video_media

REPO = Path(__file__).resolve().parent.parent
ALL_FAMILIES = ["tiny-qwen2.5-vl", "tiny-smolvlm2", "tiny-qwen3-vl", "tiny-llava-onevision", "tiny-internvl3.5"]
NAME = "blockwise-keynorm"


def example_file() -> str:
    """The python block of the section, the one saved as a method file."""
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("## How to add a method", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"saved as `visualkv/methods/(\w+)\.py`:\n\n```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the section names the file and shows it"
    return block.group(2)


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The doc's file saved verbatim and imported as a module (its `@register` line runs), then unregistered."""
    from visualkv.methods import METHODS

    source = example_file()
    assert len(source.splitlines()) <= 40
    path = tmp_path / "keynorm.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("keynorm", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "keynorm", module)
    assert NAME not in METHODS
    spec.loader.exec_module(module)
    assert METHODS[NAME] is module.BlockwiseKeyNorm
    yield module
    del METHODS[NAME]


def test_the_method_appears_everywhere(registered, tmp_path, capsys):
    from PIL import Image

    from ui.text import method_choices
    from visualkv.cli.main import main
    from visualkv.methods import method_names
    from visualkv.runtime.session import SessionConfig
    from visualkv.runtime.streaming import method_settings, stream_compare

    assert NAME in method_names() and f"{NAME}+salicache" in method_names()
    assert NAME in method_choices() and [s.key for s in method_settings(NAME)] == ["p"]
    image = tmp_path / "a.png"
    Image.fromarray(image_media(224, 168, seed=1).frames[0]).save(image)
    argv = ["run", "--model", "tiny-qwen2.5-vl", "--media", str(image), "--prompt", "What is this?", "--quiet"]
    assert main([*argv, "--method", NAME, "--budget", "8", "--keynorm-p", "1", "--max-new-tokens", "2"]) == 0
    assert main([*argv, "--method", "full", "--keynorm-p", "1"]) == 2  # its flag belongs to it
    assert "applies to --method blockwise-keynorm" in capsys.readouterr().err
    adapter = get_adapter("tiny-qwen2.5-vl")
    base = SessionConfig(budget=8, block_size=16, max_new_tokens=2)
    events = list(stream_compare(adapter, image_media(224, 168, seed=1), "What?", ["full", NAME], base))
    results = dict(payload for kind, payload in events if kind == "result")
    assert events[-1][0] == "done" and results[NAME]["method"] == NAME  # a report, not an error line
    assert results[NAME]["final_kv_bytes"] < results["full"]["final_kv_bytes"]


def test_the_file_dropped_into_the_package_is_a_cli_method(tmp_path):
    """Nothing else to edit: a copy of the package with the file saved as the section says runs `run --method`."""
    import os
    import shutil
    import subprocess

    from PIL import Image

    shutil.copytree(REPO / "visualkv", tmp_path / "visualkv", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "visualkv" / "methods" / "keynorm.py").write_text(example_file())
    image = tmp_path / "a.png"
    Image.fromarray(image_media(224, 168, seed=1).frames[0]).save(image)
    argv = ["run", "--model", "tiny-qwen2.5-vl", "--media", str(image), "--prompt", "What is this?", "--quiet"]
    argv += ["--method", f"{NAME}+salicache", "--budget", "8", "--max-new-tokens", "2"]
    argv += ["--json", str(tmp_path / "r.json")]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "visualkv", *argv]
    out = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    report = (tmp_path / "r.json").read_text()
    assert f'"method": "{NAME}+salicache"' in report and '"stages": [' in report


@pytest.mark.slow
@pytest.mark.parametrize("alias", ALL_FAMILIES)
def test_the_method_passes_the_invariant_suite(registered, alias):
    """Bound, telemetry, protected tokens, original positions, and exactness with nothing to evict."""
    adapter = get_adapter(alias)
    # conftest's media; InternVL's image in two tiles + a thumbnail, as tests/test_new_families.py has it
    image = image_media(896, 448, seed=1) if alias == "tiny-internvl3.5" else image_media(448, 336, seed=1)
    video = video_media(8, 224, 168, fps=1.0, seed=2)
    for block in (70, 16):
        with pytest.MonkeyPatch.context() as mp:
            inv.test_visual_entries_never_exceed_budget_plus_block_or_unit(adapter, image, video, NAME, block, mp)
    with pytest.MonkeyPatch.context() as mp:
        inv.test_telemetry_agrees_with_an_independent_count(adapter, image, video, NAME, mp)
    inv.test_protected_tokens_survive(adapter, image, video, NAME)
    for kind in ("image", "video"):
        inv.test_kept_entries_keep_original_positions(adapter, image, video, NAME, kind)
    if alias == ALL_FAMILIES[0]:
        inv.test_forced_blocks_without_eviction_are_exact(NAME, image, video)
