"""scripts/decode_attention.py (the decode step's attention three ways, for the next GPU session): on CPU at
small sizes the three agree with a float64 reference over the written slots only, and the JSON says so."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "decode_attention.py"


def _script():
    spec = importlib.util.spec_from_file_location("decode_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_ways_agree_and_the_json_records_them(tmp_path):
    out = tmp_path / "decode_attention.json"
    argv = [
        str(out),
        "--entries",
        "40,300",
        "--window-room",
        "9",
        "--repeats",
        "1",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    assert _script().main(argv) == 0
    data = json.loads(out.read_text())
    assert data["geometry"] == {"heads": 28, "kv_heads": 4, "head_dim": 128, "layers": 28}  # Qwen2.5-VL-7B
    rows = data["rows"]
    assert [(r["entries"], r["case"]) for r in rows] == [(n, c) for n in (40, 300) for c in _script().CASES]
    # the unwritten slots of the window hold random values: attending to one of them would show here
    assert all(r["max_abs_difference"] < 1e-5 for r in rows), rows
    assert all(r["seconds_per_call"] > 0 and r["kv_bytes"] == 2 * 4 * (r["entries"] + 1) * 128 * 4 for r in rows)
    assert data["provenance"]["command"].startswith("python scripts/decode_attention.py ")
