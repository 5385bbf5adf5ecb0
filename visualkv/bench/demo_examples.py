"""The bundled demo model's example media and the questions it was trained to answer.

`scripts/make_examples.py` writes `assets/visualkv-demo/examples.json` (scene files, needles, every
closed question with its answer). This module reads it for the app's examples and its "what the demo
model can answer" panel. The demo model knows only these synthetic scenes and question forms.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from visualkv.bench.scenes import (
    NEEDLE_SHAPES,
    PLURAL,
    color_question,
    presence_question,
    quadrant_question,
    when_question,
)
from visualkv.models.registry import BUNDLED_MODELS, DEMO_MODEL

DEMO_DIR = BUNDLED_MODELS[DEMO_MODEL]
# the question kinds shown first for each file: the ones that need the needle's own tokens
FEATURED_KINDS = {"image": ("color", "quadrant"), "video": ("when", "color")}


@dataclass(frozen=True)
class DemoQuestion:
    question: str
    answer: str
    kind: str  # color | quadrant | presence | count | when


@dataclass(frozen=True)
class DemoExample:
    path: str
    kind: str  # image | video
    width: int
    height: int
    questions: tuple[DemoQuestion, ...]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def featured(self) -> list[DemoQuestion]:
        """One question per featured kind (in order), for the app's example list."""
        picked = []
        for kind in FEATURED_KINDS[self.kind]:
            picked += [q for q in self.questions if q.kind == kind][:1]
        return picked


def load_demo_examples(folder: str = DEMO_DIR) -> list[DemoExample]:
    """The examples listed in `folder`/examples.json whose media exists; [] without the manifest."""
    manifest = os.path.join(folder, "examples.json")
    if not os.path.isfile(manifest):
        return []
    with open(manifest) as fh:
        items = json.load(fh).get("examples", [])
    examples = []
    for item in items:
        path = os.path.join(folder, item["file"])
        if not os.path.isfile(path):
            continue
        width, height = item["size"]
        examples.append(
            DemoExample(
                path=path,
                kind="video" if "frames" in item else "image",
                width=width,
                height=height,
                questions=tuple(DemoQuestion(q["question"], q["answer"], q["kind"]) for q in item["questions"]),
            )
        )
    return examples


def question_forms() -> dict[str, list[str]]:
    """The question templates the demo model was trained on, with X standing for a needle shape."""
    x = "X"
    plurals = ", ".join(PLURAL[s] for s in NEEDLE_SHAPES)
    return {
        "image": [
            color_question(x),
            quadrant_question(x),
            presence_question(x),
            f"How many X are there? (X plural: {plurals})",
        ],
        "video": [when_question(x), color_question(x, past=True), presence_question(x)],
        "shapes": list(NEEDLE_SHAPES),
    }
