"""The parts of the code a table's figures measure, as source paths from the repository root.

Each table module's ``MEASURES`` (block name -> paths) is built from these; `visualkv.bench.staleness` notes a
table measured before the newest commit touching its paths.
"""

from __future__ import annotations

#: the prefill driver and what every prefill runs through: attention, the cache, the method interface
PREFILL = ("visualkv/runtime/engine.py", "visualkv/attention", "visualkv/kv", "visualkv/methods/base.py")
#: the decode loops (eager, static and graph-captured) after a prefill
DECODE = ("visualkv/runtime/decode_loop.py", "visualkv/runtime/static_decode.py")
#: a chat turn end to end: the session, the memory guard and the parked state around prefill and decode
SESSION = ("visualkv/runtime/session.py", "visualkv/runtime/memory_guard.py", "visualkv/runtime/park.py")
FULL = ("visualkv/methods/full.py",)
BLOCKWISE = ("visualkv/methods/blockwise.py", "visualkv/methods/eviction.py", "visualkv/scoring.py")
POST_PREFILL = ("visualkv/methods/post_prefill.py", "visualkv/methods/eviction.py", "visualkv/scoring.py")
SALICACHE = ("visualkv/methods/salicache.py", "visualkv/media/saliency.py")
LIGHTKV = ("visualkv/methods/lightkv.py",)
COMPOSED = ("visualkv/methods/compose.py", *BLOCKWISE, *SALICACHE)
#: every method a table may name
METHODS = ("visualkv/methods", "visualkv/scoring.py", "visualkv/media/saliency.py")
#: reading images and videos into frames
MEDIA = ("visualkv/media",)


def paths(*parts: tuple[str, ...]) -> tuple[str, ...]:
    """The paths of `parts`, each once, in first-seen order."""
    return tuple(dict.fromkeys(p for part in parts for p in part))
