"""Shared mode: which models a public instance loads, what its messages and reports reveal, session cleanup."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from tests.conftest import get_adapter
from visualkv.bench.synthetic import synthetic_image
from visualkv.errors import ModelLoadError
from visualkv.media import load_media
from visualkv.models.registry import HUB_MODELS
from visualkv.runtime.access import ModelPolicy, is_public, scrub_paths
from visualkv.runtime.session import ChatSession, SessionConfig


@pytest.mark.parametrize(
    ("share", "public", "env", "expected"),
    [
        (False, False, {}, False),
        (True, False, {}, True),
        (False, True, {}, True),
        (False, False, {"SPACE_ID": "someone/visualkv"}, True),
        (False, False, {"VISUALKV_PUBLIC": "1"}, True),
        (False, False, {"VISUALKV_PUBLIC": "0"}, False),
    ],
)
def test_public_when_shared_flagged_or_on_a_space(share, public, env, expected):
    assert is_public(share=share, public=public, environ=env) is expected


def test_local_mode_loads_anything():
    policy = ModelPolicy.create(public=False, environ={})
    for name in ("/etc", "../secret", "someone/any-model", "tiny-qwen2.5-vl"):
        policy.check(name)


def test_public_mode_allows_aliases_suggested_and_added_ids():
    policy = ModelPolicy.create(public=True, extra=["me/extra-vl"], environ={"VISUALKV_ALLOWED_MODELS": "a/b, c/d"})
    for name in ("visualkv-demo", "tiny-qwen2.5-vl", "bench-smolvlm2", *(c.name for c in HUB_MODELS)):
        policy.check(name)
    for name in ("me/extra-vl", "a/b", "c/d"):
        policy.check(name)


def test_public_mode_leaves_shape_models_to_the_operator():
    """A shape model builds billions of random weights on the server: listed only with --allow-model."""
    with pytest.raises(ModelLoadError):
        ModelPolicy.create(public=True, environ={}).check("shape-qwen2.5-vl-7b")
    ModelPolicy.create(public=True, extra=["shape-qwen2.5-vl-7b"], environ={}).check("shape-qwen2.5-vl-7b")


@pytest.mark.parametrize("name", ["someone/huge-model", "/etc", "/no/such/folder", "../assets", "~/.cache", "assets"])
def test_public_mode_refuses_other_ids_and_paths_with_the_same_line(name):
    policy = ModelPolicy.create(public=True, environ={})
    with pytest.raises(ModelLoadError) as err:
        policy.check(name)
    message = str(err.value)
    # the same line whether the path exists or not: nothing about the server's files leaks
    assert (
        message == "this shared instance only loads its listed models (pick one from the model list); "
        "run VisualKV locally to load any Hub id or folder"
    )


def test_model_cache_enforces_the_policy_before_loading(monkeypatch):
    from ui.state import ModelCache

    def must_not_load(*args, **kwargs):
        raise AssertionError("a refused model must not reach load_model")

    monkeypatch.setattr("ui.state.load_model", must_not_load)
    cache = ModelCache(policy=ModelPolicy.create(public=True, environ={}))
    with pytest.raises(ModelLoadError, match="only loads its listed models"):
        cache.get("/etc")


def test_public_load_errors_show_no_server_path(monkeypatch):
    from ui.state import ModelCache

    def failing(name, device="cpu"):
        raise ModelLoadError(f"cannot load model {name!r}: no file /root/.cache/huggingface/hub/models--x/config.json")

    monkeypatch.setattr("ui.state.load_model", failing)
    allowed = HUB_MODELS[0].name
    with pytest.raises(ModelLoadError) as err:
        ModelCache(policy=ModelPolicy.create(public=True, environ={})).get(allowed)
    assert "/root" not in str(err.value) and allowed in str(err.value) and "config.json" in str(err.value)
    with pytest.raises(ModelLoadError, match="/root/.cache"):  # locally the full message helps its owner
        ModelCache(policy=ModelPolicy(public=False)).get(allowed)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("model path '/srv/models/x' does not exist", "model path 'x' does not exist"),
        (
            "cannot load 'Qwen/Qwen2.5-VL-3B-Instruct': see /tmp/a/b.log",
            "cannot load 'Qwen/Qwen2.5-VL-3B-Instruct': see b.log",
        ),
        (r"C:\Users\me\clip.mp4 is broken", "clip.mp4 is broken"),
        ("ratio 1/2 (~/x/y)", "ratio 1/2 (y)"),
        # web addresses are public and stay whole; a file:// URL is a server path
        (
            "see https://huggingface.co/org/name/tree/main (from /srv/app/log.txt)",
            "see https://huggingface.co/org/name/tree/main (from log.txt)",
        ),
        ("http://localhost:7860/x and file:///etc/secret", "http://localhost:7860/x and file:secret"),
    ],
)
def test_scrub_paths(message, expected):
    assert scrub_paths(message) == expected


def test_the_public_model_list_offers_only_models_it_loads():
    """A shared page lists no model it would then refuse (shape models are the operator's to add)."""
    from ui.layout import model_choices

    policy = ModelPolicy.create(public=True, environ={})
    listed = model_choices("visualkv-demo", policy)
    assert listed and all(policy.permits(name) for name in listed), listed
    assert not [name for name in listed if name.startswith("shape-")], listed
    assert any(name.startswith("shape-") for name in model_choices("visualkv-demo"))  # locally they are offered
    extra = ModelPolicy.create(public=True, extra=["shape-qwen2.5-vl-7b"], environ={})
    assert "shape-qwen2.5-vl-7b" in model_choices("visualkv-demo", extra)


def test_a_model_path_that_is_a_file_or_relative_is_said_truly(tmp_path, monkeypatch):
    """Locally, a file given as a model is called a file (not "does not exist"), `~` is the home folder, and a
    missing relative path says which folder it was read from."""
    from visualkv.models.registry import load_model

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="is a file, not a model folder") as err:
        load_model(str(weights))
    assert "does not exist" not in str(err.value)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model("~/model.safetensors")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match=f"does not exist \\(a relative path is read from {tmp_path}\\)"):
        load_model("./no-such-folder")


def test_report_names_the_file_but_carries_no_path(tmp_path):
    path = tmp_path / "secret-folder" / "scene.png"
    path.parent.mkdir()
    Image.fromarray(synthetic_image(448, 336, 1)).save(path)
    session = ChatSession(get_adapter("tiny-qwen2.5-vl"), SessionConfig(method="full", max_new_tokens=2))
    session.ask("What is there?", load_media(str(path)))
    report = session.report()
    assert report["media"]["name"] == "scene.png"
    text = json.dumps(report)
    assert str(tmp_path) not in text and "secret-folder" not in text and os.sep + "scene.png" not in text


def test_release_frees_a_closed_session():
    from ui.sharing import release_state
    from ui.state import UserState

    st = UserState(model_name="tiny-qwen2.5-vl")
    st.session, st.history, st.media_path = object(), [{"role": "user", "content": "hi"}], "x.png"
    old_stop = st.stop
    release_state(st)
    assert st.session is None and st.history == [] and st.media_path is None and old_stop.is_set()
    release_state(None)  # a session that never chatted has no state


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500MB", 500 * 1024**2),
        ("4GB", 4 * 1024**3),
        ("1.5 GiB", 1536 * 1024**2),
        ("200mb", 200 * 1024**2),
        ("4096", 4096),
    ],
)
def test_upload_sizes_parse_like_gradio(text, expected):
    from ui.size import parse_size

    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4XB", "-3GB", "0", "", "lots"])
def test_a_bad_max_upload_is_one_line_and_exit_2(bad):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "app.py", f"--max-upload={bad}"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("app.py: error: --max-upload:"), done.stderr


def test_max_upload_reaches_the_handlers_and_gradio(monkeypatch):
    import ui.app as app_module
    from ui.sharing import ServeOptions

    seen = {}
    demo = app_module.build_app("tiny-qwen2.5-vl", serve=ServeOptions(max_upload_bytes=4 * 1024**3))
    monkeypatch.setattr(type(demo), "queue", lambda self, **kw: self)
    monkeypatch.setattr(type(demo), "launch", lambda self, **kw: seen.update(kw))
    app_module.launch(demo)
    assert seen["max_file_size"] == 4 * 1024**3
    turns = next(fn.fn.__self__ for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "chat")
    assert turns.context.max_file_bytes == 4 * 1024**3


# -- every setting has a bound, tighter on a shared instance ------------------------------------------------

#: each bounded field of the settings form and the name its one-line error gives it
FIELD_LABELS = {
    "budget": "budget M",
    "block_size": "block size",
    "max_new": "max new tokens",
    "temperature": "temperature",
    "vision_ahead": "blocks per vision-tower call",
    "fps": "frames per second sampled",
    "max_frames": "frames sampled at most",
}
BOUNDED_FIELDS = tuple(FIELD_LABELS)


def _checked(form, bounds) -> None:
    """Every check the app makes of the settings form before a turn (the config, then the video sampling)."""
    form.session_config([], bounds)
    form.sampling(bounds)


@pytest.mark.parametrize("name", BOUNDED_FIELDS)
def test_shared_bounds_are_tighter_and_refused_in_one_line(name):
    """A value past the shared maximum runs locally and is refused on a shared instance in one line naming the
    field, its range and whose limit it is; the shared maximum itself is accepted."""
    from dataclasses import replace

    from ui.bounds import LOCAL, SHARED
    from ui.forms import DEFAULTS
    from visualkv.errors import ConfigError

    shared_max, local_max = getattr(SHARED, name), getattr(LOCAL, name)
    assert shared_max <= local_max and (shared_max < local_max or name == "temperature")  # nothing scales cost
    if shared_max == local_max:
        return
    past = shared_max + 1 if isinstance(shared_max, int) else shared_max * 2
    _checked(replace(DEFAULTS, **{name: shared_max}), SHARED)
    _checked(replace(DEFAULTS, **{name: past}), LOCAL)
    with pytest.raises(ConfigError) as refused:
        _checked(replace(DEFAULTS, **{name: past}), SHARED)
    line = str(refused.value)
    assert (
        line.startswith(FIELD_LABELS[name])
        and "\n" not in line
        and f"{shared_max:,}" in line.replace(f"{shared_max:g}", f"{shared_max:,}")
    ), line
    if isinstance(shared_max, int):
        assert "on this shared instance" in line, line
    with pytest.raises(ConfigError):  # past the local maximum too
        _checked(replace(DEFAULTS, **{name: local_max * 2}), LOCAL)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_setting_is_one_line(bad):
    from dataclasses import replace

    from ui.bounds import LOCAL
    from ui.forms import DEFAULTS
    from visualkv.errors import ConfigError

    for name in BOUNDED_FIELDS:
        with pytest.raises(ConfigError, match=f"^{FIELD_LABELS[name]} must be"):
            _checked(replace(DEFAULTS, **{name: bad}), LOCAL)


def test_a_shared_instance_checks_its_turns_and_shows_its_maxima():
    """The shared bounds reach the chat's checks and the fields' help text; a local app keeps the local ones."""
    from dataclasses import replace

    import ui.app as app_module
    from ui.bounds import LOCAL, SHARED
    from ui.forms import DEFAULTS
    from ui.sharing import ServeOptions
    from ui.state import UserState
    from visualkv.errors import ConfigError

    for public, bounds in ((True, SHARED), (False, LOCAL)):
        demo = app_module.build_app("tiny-qwen2.5-vl", serve=ServeOptions(public=public))
        turns = next(fn.fn.__self__ for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "chat")
        assert turns.context.bounds == bounds
        info = next(b.info for b in demo.blocks.values() if getattr(b, "elem_id", None) == "vkv-max-new")
        assert info == f"1 to {bounds.max_new:,}"
        form = replace(DEFAULTS, max_new=SHARED.max_new + 1)
        if public:
            with pytest.raises(ConfigError, match="max new tokens .* on this shared instance"):
                turns._open(UserState(model_name="tiny-qwen2.5-vl"), "What?", [], form)
        else:
            assert turns._open(UserState(model_name="tiny-qwen2.5-vl"), "What?", [], form).session is not None


def test_docs_list_the_bounds_in_force():
    """docs/APP.md's table of maxima is the table of ui/bounds.py (no hand-kept copy drifts)."""
    from pathlib import Path

    from ui.bounds import LOCAL, SHARED

    doc = (Path(__file__).resolve().parent.parent / "docs" / "APP.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in map(str.strip, doc.splitlines()) if line.startswith("| ")}
    for name, label in FIELD_LABELS.items():
        cells = [cell.strip().split(" ")[0] for cell in rows[label].split("|")[2:4]]
        shown = [f"{v:,}" if isinstance(v, int) else f"{v:g}" for v in (getattr(LOCAL, name), getattr(SHARED, name))]
        assert cells == shown, (label, cells)


@pytest.mark.parametrize(
    "method, key",
    [
        ("blockwise-snapkv", "window"),
        ("post-snapkv", "window"),
        ("salicache", "downscale_width"),
        ("blockwise-keydiff+salicache", "salicache:downscale_width"),
    ],
)
def test_costly_method_settings_are_capped_when_shared(method, key):
    """A method setting whose cost grows with it runs locally past the shared cap and is refused in one line when
    shared (the cap itself is accepted)."""
    from dataclasses import replace

    from ui.bounds import LOCAL, SHARED
    from ui.forms import DEFAULTS
    from visualkv.errors import ConfigError
    from visualkv.runtime.streaming import method_settings

    cap = SHARED.method[key.rsplit(":", 1)[-1]]
    keys = [(method, s.key) for s in method_settings(method)]
    assert (method, key) in keys

    def form(value):
        values = tuple(value if k == key else None for _, k in keys)  # None: the method's default
        return replace(DEFAULTS, method=method, budget=64, method_values=values)

    assert form(cap).session_config(keys, SHARED).method == method
    assert form(cap + 1).session_config(keys, LOCAL).method == method
    with pytest.raises(ConfigError) as refused:
        form(cap + 1).session_config(keys, SHARED)
    line = str(refused.value)
    assert (
        line
        == f"{method} {key.rsplit(':', 1)[-1].replace('_', ' ')} must be at most {cap:,} on this shared instance, got {cap + 1}"
    )
