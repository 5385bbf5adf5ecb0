"""Hub ids with the Hub unreachable: a cached model loads at once from the cache, a missing one fails in one line.

Nothing here reaches a hub: the "Hub" is a port on 127.0.0.1 (closed, or a listening socket of the test's own).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from visualkv.models.hub import hub_reachable

REPO = Path(__file__).resolve().parents[1]
#: proxy variables of the machine running the tests would change where a request connects first
PROXY_VARS = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
)
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_reachable_asks_the_endpoint_and_respects_offline_mode(monkeypatch):
    for name in OFFLINE_VARS + PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_reachable(timeout=2.0)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline mode: not asked, even though it would answer
        assert not hub_reachable(timeout=2.0)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert not hub_reachable(timeout=2.0)


def test_behind_a_proxy_the_proxy_is_asked(monkeypatch):
    """With $HTTPS_PROXY set, downloads go through the proxy: an endpoint unreachable directly is still reachable."""
    for name in OFFLINE_VARS + PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # reserved name: no DNS answer, never a real host
    assert not hub_reachable(timeout=2.0)
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        assert hub_reachable(timeout=2.0)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{_closed_port()}")
    assert not hub_reachable(timeout=2.0)


@pytest.fixture(scope="module")
def unreachable_hub(tmp_path_factory) -> tuple[dict, Path]:
    """An environment whose Hub is a closed local port, with tiny-qwen2.5-vl in its cache as fake-org/cached-tiny."""
    from visualkv.bench.synthetic import synthetic_image
    from visualkv.models.synthetic.tiny import save_tiny

    root = tmp_path_factory.mktemp("hub")
    repo = root / "cache" / "models--fake-org--cached-tiny"
    save_tiny("tiny-qwen2.5-vl", str(repo / "snapshots" / "0123abcd"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    image = root / "a.png"
    Image.fromarray(synthetic_image(224, 168)).save(image)
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS + PROXY_VARS}
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        HF_HUB_CACHE=str(root / "cache"),
        HF_HOME=str(root),
        PYTHONPATH=str(REPO),
    )
    return env, image


def _run_cli(env: dict, image: Path, model: str) -> subprocess.CompletedProcess:
    argv = ["run", "--model", model, "--media", str(image), "--prompt", "hi", "--quiet", "--max-new-tokens", "2"]
    # the timeout is a backstop only: before the check, the cached load retried every file for about 7 minutes
    return subprocess.run(
        [sys.executable, "-m", "visualkv", *argv],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_a_cached_model_loads_without_asking_the_unreachable_hub(unreachable_hub):
    env, image = unreachable_hub
    result = _run_cli(env, image, "fake-org/cached-tiny")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), result.stderr
    assert "Could not reach the Hub" not in result.stderr and "Retrying" not in result.stderr, result.stderr


def test_a_model_missing_from_the_cache_fails_in_one_line(unreachable_hub):
    env, image = unreachable_hub
    result = _run_cli(env, image, "fake-org/not-cached")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "not in the local Hugging Face cache" in lines[0] and "Hub cannot be reached" in lines[0], lines[0]
