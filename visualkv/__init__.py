"""VisualKV: KV-cache compression for vision-language models on 4K images and long videos.

The library in five names (the README's *Python library* section runs this, and a test runs the README):

    import visualkv

    model = visualkv.load_model("visualkv-demo")  # an offline alias, a local folder or a Hub id
    media = visualkv.load_media("scene.png")  # an image, or a video (decoded lazily, block by block)
    chat = visualkv.ChatSession(model, visualkv.SessionConfig(method="blockwise-snapkv", budget=256))
    print(chat.ask("Is there a cross?", media).answer)  # later turns: chat.ask("...") reuses the cache
    report = chat.report()  # the CLI's --json report: memory, blocks, kept tokens, per turn

The names are imported on first use, so `import visualkv` (and `python -m visualkv --help`) stays instant.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "load_model": "visualkv.models.registry",
    "load_media": "visualkv.media",
    "FrameSampling": "visualkv.media",
    "MediaLimits": "visualkv.media",
    "Media": "visualkv.media",
    "ChatSession": "visualkv.runtime.session",
    "SessionConfig": "visualkv.runtime.session",
    "BlockEvent": "visualkv.report.telemetry",
    "TurnRecord": "visualkv.report.telemetry",
    "write_json": "visualkv.report.telemetry",
    "method_names": "visualkv.methods",
    "media_limits": "visualkv.runtime.frame_cap",
    "VisualKVError": "visualkv.errors",
    "ConfigError": "visualkv.errors",
}

__all__ = [  # spelled out for linters and `from visualkv import *`; equal to _EXPORTS' names (a test checks)
    "BlockEvent",
    "ChatSession",
    "ConfigError",
    "FrameSampling",
    "Media",
    "MediaLimits",
    "SessionConfig",
    "TurnRecord",
    "VisualKVError",
    "__version__",
    "load_media",
    "load_model",
    "media_limits",
    "method_names",
    "write_json",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports on first use
    from visualkv.errors import ConfigError, VisualKVError
    from visualkv.media import FrameSampling, Media, MediaLimits, load_media
    from visualkv.methods import method_names
    from visualkv.models.registry import load_model
    from visualkv.report.telemetry import BlockEvent, TurnRecord, write_json
    from visualkv.runtime.frame_cap import media_limits
    from visualkv.runtime.session import ChatSession, SessionConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'visualkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
