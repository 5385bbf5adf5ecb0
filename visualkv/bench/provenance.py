"""Where a benchmark figure came from: the command, the machine, how loaded it was, the code version.

Every benchmark JSON carries a ``provenance`` block written by :func:`save_json`, so a figure in
README.md or docs/ can always be traced to the run that produced it (``python -m visualkv bench
report`` prints the command and the machine beside each generated table).

Load: the 1-minute load average is read when the run starts and when it ends. A run is ``idle``
when both stay at or below the number of cores plus 0.5 (the benchmark itself keeps about one core
busy; more runnable processes than cores means something else competed for them), ``loaded``
otherwise. Wall-clock ratios from a loaded run are noisier; memory figures are exact either way.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from typing import Any


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def _git_commit(folder: str | None = None) -> str | None:
    """The checkout's HEAD, with "+changes" when tracked files differ from it (the measured code is not
    that commit then; a GPU run measures the working tree it was sent, committed or not). Result files under
    docs/results/ do not count: a run of several benchmarks rewrites them as it goes, and they are data, not
    the code measured."""
    here = folder or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)docs/results")
    return head + ("+changes" if changed else "")


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def start(argv: list[str] | None = None) -> dict[str, Any]:
    """Provenance of a run that starts now; `argv` defaults to this process's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": "python -m visualkv " + " ".join(args),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "load_start": _loadavg(),
        "commit": _git_commit(),
        "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def finish(prov: dict[str, Any]) -> dict[str, Any]:
    """Add the end-of-run reading and the idle/loaded verdict (see the module docstring)."""
    out = dict(prov)
    out["load_end"] = _loadavg()
    out["gpu"] = _gpu_name()
    loads = [v for v in (out.get("load_start"), out["load_end"]) if v is not None]
    cores = out.get("cpu_cores") or 1
    out["condition"] = "unknown" if not loads else ("idle" if max(loads) <= cores + 0.5 else "loaded")
    return out


def machine_label(prov: dict[str, Any] | None) -> str:
    """One phrase for a table caption, e.g. '2 CPU cores, idle' or 'NVIDIA H200, loaded'."""
    if not prov:
        return "machine not recorded"
    where = prov.get("gpu") or f"{prov.get('cpu_cores', '?')} CPU cores"
    label = f"{where}, {prov.get('condition', 'unknown')}"
    return label + (" (recorded afterwards)" if prov.get("recorded") else "")


def save_json(out: dict[str, Any], path: str, prov: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a benchmark result with its provenance (finished now); returns what was written."""
    result = dict(out)
    result["provenance"] = finish(prov if prov is not None else start())
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    return result
