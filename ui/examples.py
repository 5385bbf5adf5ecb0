"""The example cards under the chat: the bundled demo model's scenes and the questions it answers.

Every card is in the demo model's domain (its synthetic scenes, a 4K still and videos among them), so a first
visitor clicking one with the app's default settings gets a right answer (tests/test_demo_model.py checks each)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from visualkv.bench.demo_examples import DemoExample

from . import text

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # the bundled media the app may serve
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".avi", ".mkv")
THUMB_SIZE = (320, 180)
#: said when a card is clicked on a chat that has begun: a chat is about one file, so the example starts a new one
EXAMPLE_NEW_CHAT = "New chat started for this example (the previous chat is cleared): press Send to ask it."
#: what runs, by the queue's name for it, as the line refusing a card says it
RUNNING_WORK = {"turn": "A chat turn", "evidence": "An evidence pass", "compare": "A comparison"}


def example_refused(running: str) -> str:
    """The line for a card clicked while this session runs something (`running`: "turn", "evidence", "compare")."""
    what = RUNNING_WORK.get(running, "A computation")
    return f"{what} is running, so the example was not loaded: press Stop or wait for it, then click the card again."


def chat_started(state) -> bool:
    """Whether the session's chat has begun (a turn ran or runs): an example then needs a new chat."""
    return state is not None and (state.session is not None or bool(state.history))


def chat_examples(demo: list[DemoExample]) -> list[dict]:
    """The chat box's examples: the featured questions on the demo scenes."""
    return [{"text": q.question, "files": [str(e.path)]} for e in demo for q in e.featured()]


def example_labels(examples: list[dict]) -> list[str]:
    """One label per example card: what the media is (4K image, video, its size) and the question."""
    return [f"{text.media_label(e['files'][0])}: {e['text']}" for e in examples]


def example_thumbnail(path: str | Path) -> Image.Image:
    """A small picture of an example file for its card: the image itself, downscaled; for a video its
    poster frame (<name>.poster.png, written by scripts/make_examples.py), else its first frame."""
    path = Path(path)
    poster = path.with_suffix(".poster.png")
    if path.suffix.lower() in VIDEO_SUFFIXES:
        if poster.is_file():
            img = Image.open(poster).convert("RGB")
        else:  # no poster (media added by hand): the first frame
            import cv2

            cap = cv2.VideoCapture(str(path))
            ok, bgr = cap.read()
            cap.release()
            img = Image.fromarray(bgr[..., ::-1]) if ok else Image.new("RGB", THUMB_SIZE, (200, 200, 200))
    else:
        img = Image.open(path).convert("RGB")
    img.thumbnail(THUMB_SIZE)
    return img


def example_cards(examples: list[dict]) -> list[tuple[Image.Image, str]]:
    """The example cards: a thumbnail (a video's poster frame) and what the file is with the question."""
    thumbs: dict[str, Image.Image] = {}  # a file with several questions is read once
    cards = []
    for example, label in zip(examples, example_labels(examples)):
        path = example["files"][0]
        if path not in thumbs:
            thumbs[path] = example_thumbnail(path)
        cards.append((thumbs[path], label))
    return cards
