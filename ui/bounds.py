"""The most each field of the settings form, a question and a chat may ask for: one table, with tighter maxima on
a shared instance.

A value outside its field's range is refused in one line naming the field and the range (ui/forms.py), before
any compute. Beneath these, the library's own bounds still hold (`SessionConfig.validate`, each method's config:
Sali-Cache's downscale width, SnapKV's pooling kernel, ...); on a shared instance the turn time limit then
bounds what a turn within these ranges may still cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from visualkv.methods import shared_caps
from visualkv.runtime.session import MAX_BUDGET, MAX_TOKENS


@dataclass(frozen=True)
class FormBounds:
    """The largest value of each bounded field (the smallest is fixed by its meaning: 1, or 0 for "auto")."""

    budget: int  # "budget M": visual entries kept per layer and KV head
    block_size: int  # visual tokens per prefill block
    max_new: int  # answer tokens per turn
    temperature: float
    vision_ahead: int  # blocks per vision-tower call
    fps: float  # video frames sampled per second
    max_frames: int  # video frames sampled at most
    #: a question's length in tokens: every layer attends over it at once (its cost grows with its square), so
    #: the cap keeps one attention call of a text pass well under a second and the time limit exact
    question_tokens: int = 4_096
    turns: int = 1_000  # turns per chat (New chat starts over): each turn's question stays in the conversation
    where: str = ""  # said after a refused range: whose limit it is
    #: method settings whose cost grows with their value, by field name, capped below the library's own bound
    method: dict[str, int] = field(default_factory=dict)


#: on your own machine: as much as the library accepts, the answer and sampling fields at sizes a person means
LOCAL = FormBounds(
    budget=MAX_BUDGET, block_size=MAX_TOKENS, max_new=4096, temperature=5.0, vision_ahead=64, fps=60.0,
    max_frames=10_800,  # 3 h at 1 fps
)  # fmt: skip
#: a shared instance (`--share`, `--public`, a Space): one visitor's turn holds the one compute slot, so every
#: field that scales its cost is capped near what the bundled examples and an hour of video at 1 fps need
SHARED = FormBounds(
    budget=16_384, block_size=8_192, max_new=512, temperature=5.0, vision_ahead=8, fps=8.0,
    max_frames=3_600,  # 1 h at 1 fps
    question_tokens=2_048, turns=32,
    where=" on this shared instance",
    method=shared_caps(),  # each method option's declared `shared_max` (visualkv.methods.options)
)  # fmt: skip


def form_bounds(public: bool) -> FormBounds:
    """The bounds of a shared instance when `public`, else the local ones."""
    return SHARED if public else LOCAL
