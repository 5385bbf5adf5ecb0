"""Whether the Hugging Face Hub can be reached, asked once and quickly before a Hub id is loaded.

Unasked, an unreachable Hub costs time: huggingface_hub retries each request with back-off ("Retrying in 8s
[Retry 5/5]"), about half a minute before a model missing from the local cache fails, and minutes, file by
file, before a cached one loads. A short TCP connect first tells the two cases apart: reachable, load as usual; unreachable,
load with `local_files_only` (a cached copy loads at once, a missing one fails at once with one line).
"""

from __future__ import annotations

import os
import socket
import urllib.request
from urllib.parse import urlparse

#: seconds a connect may take before the Hub counts as unreachable (a slow link still answers well within it)
CONNECT_TIMEOUT_S = 3.0
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_mode() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set: the Hub is not to be asked at all.

    Read now, not once at import as huggingface_hub's `is_offline_mode()` does, so a change after import counts.
    """
    return any(os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"} for name in _OFFLINE_VARS)


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """True when a TCP connection to the Hub endpoint ($HF_ENDPOINT, else huggingface.co), or to the proxy set
    for it, opens within `timeout`.

    Offline mode answers False without connecting.
    """
    if offline_mode():
        return False
    try:
        socket.create_connection(_first_hop(), timeout=timeout).close()
    except (OSError, ValueError):  # no DNS, refused, timed out, or a malformed endpoint
        return False
    return True


def _first_hop() -> tuple[str, int]:
    """Where a Hub request connects first: the endpoint, or the proxy that $HTTPS_PROXY & co. name for it.

    Behind a proxy the endpoint itself is often not reachable directly while downloads work through the proxy.
    """
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or ""
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        return via.hostname or "", via.port or (443 if via.scheme == "https" else 80)
    return host, endpoint.port or (443 if endpoint.scheme == "https" else 80)
