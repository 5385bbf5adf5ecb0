"""Words on the page: explanations of methods, settings and follow-up behaviour."""

from __future__ import annotations

import json
from pathlib import Path

from visualkv.errors import ConfigError
from visualkv.methods import METHODS, MethodTraits, method_names, method_traits
from visualkv.report.viz import md_literal

INTRO = (
    "## VisualKV: chat with 4K images and long videos while the model's KV cache is compressed\n"
    "Attach an image or video (or pick an example under the chat), ask, and see on the right what the cache "
    "kept, block by block."
)

EMPTY_HEAT_NOTE = (
    "Ask a question about an image or video to compare it with the tokens its cache kept "
    "(drag the slider: left the media, right the keep map)."
)


def method_choices() -> list[str]:
    """Every method name the app offers (method dropdown, Compare, settings groups) and accepts: the one
    place the app reads the list of choosable methods from."""
    return method_names()


def traits(name: str) -> MethodTraits | None:
    """The flags of a single or composed method, or None for a name this installation does not know."""
    try:
        return method_traits(name)
    except ConfigError:
        return None


def md_escape(text: str) -> str:
    """Show `text` literally inside Markdown (error messages carry paths, quotes, underscores)."""
    return md_literal(text)


#: the words the settings use, explained (behind the settings column's info toggle)
GLOSSARY = (
    "- **visual tokens**: the pieces the model cuts an image or video into (a 4K image is about ten thousand).\n"
    "- **KV cache**: the model's memory of what it read; it grows with every visual token, and compressing it is "
    "what this app shows.\n"
    "- **keep %** / **budget M**: how many visual tokens the cache keeps, as a share or as a number. M counts entries "
    "per layer and **KV head** (the model's attention reads its memory in several heads per layer; each keeps M).\n"
    "- **block**: a piece of the media read at a time. While a block is read, the cache holds the budget plus that "
    "block, then drops back to the budget.\n"
    "- **tiers** (Sali-Cache): precisions the kept tokens are stored at (full, 8-bit, 4-bit).\n"
    "- **query-aware**: the method keeps what the question looks at; **query-agnostic**: the same parts whatever "
    "the question."
)


def plain_description(name: str) -> str:
    """One plain line about a (single or composed) method: each stage's `plain` line, declared on its class (its
    `description`, in the field's words, is behind the help's "details" toggle)."""
    stages = [getattr(METHODS.get(stage), "plain", "") for stage in name.split("+")]
    if all(stages):
        return "; and ".join(stages)
    cls = traits(name)
    return (cls.description if cls else "") or "no description"


def methods_in_plain_words(names: list[str]) -> str:
    """Every method of the list with its plain line (the info toggle under the method choice)."""
    return "\n".join(f"- **{name}**: {plain_description(name)}" for name in names)


def method_line(name: str) -> str:
    """One plain line about a method, its class's description and flags behind a "details" toggle."""
    cls = traits(name)
    if cls is None:
        return f"`{name}` is not available in this installation."
    flags = []
    flags.append("uses the budget" if cls.needs_budget else "no budget")
    flags.append("query-aware" if cls.query_aware else "query-agnostic")
    details = f"{cls.description or 'no description'} ({', '.join(flags)})"
    return f"**{name}**: {plain_description(name)}. <details><summary>details</summary>{md_escape(details)}</details>"


def followup_note(name: str, followup: str) -> str:
    """What a follow-up question means for the chosen method, in plain words."""
    cls = traits(name)
    if cls is None:
        return ""
    if name == "full":
        return "Follow-up questions use everything the model read: nothing was dropped."
    if cls.query_aware and followup == "reprefill":
        return (
            "Each follow-up question makes the model read the image or video **again**, keeping what matters for "
            "that question (slower, but no detail is lost between questions)."
        )
    if cls.query_aware:
        return (
            "Follow-up questions reuse what the model kept for your **first** question: details it dropped then are "
            "gone. To ask about something else, set *follow-up turns* to *read the media again*, or choose a method "
            "that keeps the same parts whatever the question."
        )
    return (
        "Follow-up questions reuse what the model kept. This method chooses what to keep without looking at the "
        "question, so every question sees the same parts of the media."
    )


#: the follow-up choice's labels: (label, value) for the radio
FOLLOWUP_CHOICES = [("reuse what was kept", "reuse"), ("read the media again", "reprefill")]

#: the prefill plan's labels: (label, value) for the dropdown
PREFILL_CHOICES = [
    ("auto: the method's default", "auto"),
    ("hybrid: one pass up to the budget, then blocks", "hybrid"),
    ("block by block from the start", "blockwise"),
    ("all at once, in one forward (bulk)", "bulk"),
]


def _unused_by(name: str) -> str | None:
    """The budget fields' help when method `name` uses no budget; None when it uses one."""
    cls = traits(name)
    if cls is not None and not cls.needs_budget:
        return f"not used by {name} (it keeps no fixed number of entries)"
    return None


def keep_info(name: str) -> str:
    """The keep % field's help: what it means, or that the chosen method does not use it."""
    return _unused_by(name) or (
        "how much of the image or video the cache keeps (e.g. 10); the figure it becomes is shown with the answer"
    )


def budget_info(name: str) -> str:
    """The budget field's help: what it means, or that the chosen method does not use it."""
    return _unused_by(name) or (
        "0 = keep % above; else a fixed number of visual entries kept per layer and KV head (see Methods and terms, explained)"
    )


def chat_followup_note(chat_method: str | None, chat_followup: str | None, chosen: str, followup: str) -> str:
    """The follow-up note for the method the chat really runs (a chat keeps the method it started with)."""
    if not chat_method or chat_method == chosen:
        return followup_note(chosen, chat_followup or followup)
    return (
        f"This chat runs **{chat_method}** (chosen when it started); {chosen} applies after New chat. "
        + followup_note(chat_method, chat_followup or followup)
    )


def media_label(path: str) -> str:
    """What an example file is, for its card: "4K image 3840×2160", "image 672×378", "video 64 s, 640×360"."""
    from PIL import Image

    p = Path(path)
    if p.suffix.lower() in (".mp4", ".webm", ".mov", ".avi", ".mkv"):
        meta = p.with_suffix(".json")
        try:
            info = json.loads(meta.read_text()) if meta.is_file() else {}
        except (OSError, ValueError):
            info = {}
        info = info or _video_header(p)
        size = f"{info['width']}×{info['height']}" if "width" in info and "height" in info else ""
        length = f"{info['duration']:g} s" if "duration" in info else ""
        return " ".join(["video", ", ".join(x for x in (length, size) if x)]).strip()
    try:
        with Image.open(p) as img:  # reads the header only
            width, height = img.size
    except OSError:
        return "image"
    return f"{'4K ' if max(width, height) >= 3840 else ''}image {width}×{height}"


def _video_header(path: Path) -> dict:
    """A video's width, height and whole-second length from its container (no sidecar JSON); {} if unreadable."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        rate, count = cap.get(cv2.CAP_PROP_FPS), cap.get(cv2.CAP_PROP_FRAME_COUNT)
    finally:
        cap.release()
    if not (width and height and rate > 0 and count > 0):
        return {}
    return {"width": width, "height": height, "duration": round(count / rate)}


def offline_note(model_name: str, offline: bool, start_error: str | None = None) -> str:
    """The line under the title: which model runs, and what its answers are worth."""
    from visualkv.models.registry import OFFLINE_MODELS

    lines = []
    if start_error:
        lines.append(
            f"⚠️ Could not load the requested start model ({md_escape(start_error)}); started on an offline model."
        )
    note = next((c.note for c in OFFLINE_MODELS if c.name == model_name), None)
    if offline and note and "random weights" not in note:
        lines.append(
            f"Running **offline** on `{model_name}` ({note}): a tiny model that needs no network. Its "
            "answers are only meant for the synthetic examples; memory, token counts and kept-token maps "
            "are real. Load a Hub model (needs network) for real answers."
        )
    elif offline:
        lines.append(
            f"Running **offline** on `{model_name}`: a model built in code with random weights. Answers are "
            "noise; memory, token counts and kept-token maps are real. Load a Hub model (needs network) for "
            "real answers."
        )
    else:
        lines.append(f"Model: `{model_name}`.")
    return "\n\n".join(lines)


def demo_questions_md(forms: dict[str, list[str]], examples: list) -> str:
    """What the bundled demo model can answer: its question forms and each example's questions with the
    right answers (so a user can check it). `examples`: `visualkv.bench.demo_examples.DemoExample`s."""
    lines = [
        (
            "`visualkv-demo` was trained only on synthetic scenes of small coloured shapes on striped backgrounds "
            "(see assets/visualkv-demo/MODEL_CARD.md). It answers these closed questions, with X one of "
            f"{', '.join(forms['shapes'])}:"
        ),
        "",
        "- images: " + " · ".join(f"*{md_escape(q)}*" for q in forms["image"]),
        "- videos: " + " · ".join(f"*{md_escape(q)}*" for q in forms["video"]),
        "",
        "Anything else gets a short, meaningless answer. Questions about the example files, with the right answers:",
        "",
        "| file | question | answer |",
        "| --- | --- | --- |",
    ]
    for example in examples:
        for q in example.questions:
            lines.append(f"| {md_escape(example.name)} | {md_escape(q.question)} | {md_escape(q.answer)} |")
    return "\n".join(lines)
