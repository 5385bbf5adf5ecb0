"""Which models a shared (public) instance may load.

Locally anything loads: an offline alias, a Hub id, a local folder. A public
instance (`--share`, `--public`, or running as a Hugging Face Space) must not let
a visitor make the server download an arbitrary Hub repository (disk, minutes of a
shared GPU) or probe its file system through the model box. There only an allow-list
loads: the offline aliases, the suggested Hub ids, and whatever the operator adds
(`--allow-model ID`, or `VISUALKV_ALLOWED_MODELS="id1,id2"`). Everything else gets
one line that says nothing about the server's files: the refusal is decided from
the name alone, before any path or Hub lookup.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from visualkv.errors import ModelLoadError

ALLOWED_ENV = "VISUALKV_ALLOWED_MODELS"
PUBLIC_ENV = "VISUALKV_PUBLIC"
# Set by Hugging Face Spaces in every Space container (https://huggingface.co/docs/hub/spaces-overview)
SPACE_ENV = "SPACE_ID"


def is_public(share: bool = False, public: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """True when the app is reachable by strangers: --share, --public, $VISUALKV_PUBLIC=1 or a Space."""
    env = os.environ if environ is None else environ
    flag = env.get(PUBLIC_ENV, "").strip().lower() in ("1", "true", "yes")
    return bool(share or public or flag or env.get(SPACE_ENV))


def default_allowed_models() -> list[str]:
    """Offline aliases (built in code or bundled) and the suggested Hub ids.

    Shape models (`shape-*`: billions of random weights, built on the server for memory and speed
    measurements) are left out: on a shared instance anyone could make it build a 7B model that only
    answers noise. An operator who wants them lists them with --allow-model.
    """
    from visualkv.models.registry import HUB_MODELS, OFFLINE_MODELS, offline_aliases
    from visualkv.models.synthetic.shapes import SHAPE_SPECS

    names = [*(c.name for c in OFFLINE_MODELS), *offline_aliases(), *(c.name for c in HUB_MODELS)]
    return [name for name in dict.fromkeys(names) if name not in SHAPE_SPECS]


def _split_ids(text: str) -> list[str]:
    return [part.strip() for part in text.replace("\n", ",").split(",") if part.strip()]


@dataclass(frozen=True)
class ModelPolicy:
    """public: enforce `allowed`; otherwise every name passes (local use is unchanged)."""

    public: bool = False
    allowed: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def create(cls, public: bool, extra: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> ModelPolicy:
        """The policy for an app: defaults + `extra` (--allow-model) + $VISUALKV_ALLOWED_MODELS."""
        env = os.environ if environ is None else environ
        names = [
            *default_allowed_models(),
            *(n.strip() for n in extra if n.strip()),
            *_split_ids(env.get(ALLOWED_ENV, "")),
        ]
        return cls(public=public, allowed=tuple(dict.fromkeys(names)))

    def permits(self, name: str) -> bool:
        return not self.public or name.strip() in self.allowed

    def check(self, name: str) -> None:
        """Raise ModelLoadError (one line, no server detail) when a public instance may not load `name`."""
        if self.permits(name):
            return
        raise ModelLoadError(
            "this shared instance only loads its listed models (pick one from the model list); "
            "run VisualKV locally to load any Hub id or folder"
        )


# an absolute POSIX or Windows path (or ~/...) not glued to a word (so "org/name" Hub ids stay), up to the
# next whitespace, quote, bracket, comma or semicolon
_PATH = re.compile(r"(?<![\w.~-])(?:~|[A-Za-z]:)?[/\\][^\s'\"()\[\]<>,;]*")


# a web address ("https://huggingface.co/org/name"): a public page, kept whole (a file:// URL is a path)
_URL = re.compile(r"\bhttps?://[^\s'\"()\[\]<>,;]+", re.IGNORECASE)


def scrub_paths(message: str) -> str:
    """`message` with every absolute path cut to its last component (what a public user may read); web
    addresses (http:// and https://) are left whole."""

    def last(match: re.Match) -> str:
        parts = [p for p in re.split(r"[/\\]", match.group(0)) if p]
        return parts[-1] if parts else ""

    pieces, start = [], 0
    for url in _URL.finditer(message):
        pieces += [_PATH.sub(last, message[start : url.start()]), url.group(0)]
        start = url.end()
    return "".join([*pieces, _PATH.sub(last, message[start:])])
