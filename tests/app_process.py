"""`python app.py` as a test's server: a free port, an offline environment, its log in a file."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def app_process(args: list[str], tmp: Path, wait_s: float = 180) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`app.py` with `args` on a free port, offline, its output in `tmp`/app.log: yields (its URL, the process,
    the log), then stops it. Fails the test when it exits or opens no port within `wait_s`."""
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
        "GRADIO_TEMP_DIR": str(tmp / "gradio"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp / "app.log"
    with log_path.open("w") as log:
        command = [sys.executable, "app.py", "--port", str(port), *args]
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for_port(proc, port, log_path, wait_s)
            yield f"http://127.0.0.1:{port}", proc, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_for_port(proc: subprocess.Popen, port: int, log_path: Path, wait_s: float) -> None:
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"app did not open its port within {wait_s:g} s")
