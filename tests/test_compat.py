"""The transformers / accelerate internals VisualKV uses (`visualkv.models.compat`) hold in the pinned version, and
no module but compat uses one.

Each check fails naming the internal that changed, so an upgrade of transformers says where to look."""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import get_adapter
from visualkv.kv.cache import CompressibleLayer
from visualkv.models import compat

LIBRARY = Path(__file__).resolve().parent.parent / "visualkv"
FAMILIES = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-smolvlm2", "tiny-internvl3.5", "tiny-llava-onevision"]
QWEN_TOWERS = ["tiny-qwen2.5-vl", "tiny-qwen3-vl"]


def _changed(name: str, what: str) -> str:
    return f"transformers internal `{name}` changed ({what}): update visualkv/models/compat.py"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _file_function(module, name: str):
    try:
        return compat.model_file_function(module, name)
    except AttributeError:
        pytest.fail(_changed(name, f"gone from {type(module).__module__}"))


def _decoder_attention(alias: str) -> torch.nn.Module:
    return get_adapter(alias).layers[0].self_attn


def _vision_attention(alias: str) -> torch.nn.Module:
    from visualkv.attention.vision import vision_attention_modules

    return vision_attention_modules(get_adapter(alias).model)[0]


def test_the_installed_transformers_is_the_pinned_one():
    pins = re.findall(r"^transformers==([\w.]+)", (LIBRARY.parent / "requirements.txt").read_text(), re.MULTILINE)
    assert pins == [transformers.__version__], f"compat is checked against transformers=={pins}: reinstall it"


@pytest.mark.parametrize("alias", FAMILIES)
def test_attn_implementation_is_the_configs_field(alias):
    config = get_adapter(alias).text_config
    own = object.__getattribute__(config, "__dict__")
    assert compat.ATTN_IMPLEMENTATION_FIELD in own, _changed("_attn_implementation", "its field is gone")
    assert compat.attention_implementation(config) == own[compat.ATTN_IMPLEMENTATION_FIELD] == "sdpa"
    saved = own[compat.ATTN_IMPLEMENTATION_FIELD]
    try:
        own[compat.ATTN_IMPLEMENTATION_FIELD] = "eager"
        assert compat.attention_implementation(config) == "eager", _changed("_attn_implementation", "not read")
    finally:
        own[compat.ATTN_IMPLEMENTATION_FIELD] = saved


@pytest.mark.parametrize("alias", FAMILIES)
def test_each_decoders_file_has_its_eager_attention_and_rope(alias):
    attention = _decoder_attention(alias)
    eager = _file_function(attention, compat.EAGER_ATTENTION)
    assert _params(eager)[:5] == ["module", "query", "key", "value", "attention_mask"], _changed(
        compat.EAGER_ATTENTION, str(_params(eager))
    )
    assert {"scaling", "dropout"} <= set(_params(eager)), _changed(compat.EAGER_ATTENTION, str(_params(eager)))
    rope = _file_function(attention, compat.TEXT_ROPE)
    assert _params(rope)[:4] == ["q", "k", "cos", "sin"], _changed(compat.TEXT_ROPE, str(_params(rope)))


@pytest.mark.parametrize("alias", FAMILIES)
def test_each_decoder_has_its_rotary_tables(alias):
    adapter = get_adapter(alias)
    hidden = torch.zeros(1, 3, adapter.text_config.hidden_size)
    positions = torch.arange(3)[None].expand(3, 3) if adapter.family in ("qwen2_5_vl", "qwen3_vl") else None
    cos, sin = adapter.rotary(hidden, positions if positions is not None else torch.arange(3)[None])
    assert cos.shape == sin.shape and cos.shape[-2:] == (3, adapter.head_dim), _changed("rotary_emb", str(cos.shape))


@pytest.mark.parametrize("alias", QWEN_TOWERS)
def test_the_qwen_vision_attention_gives_a_flash_name_every_chunk_in_one_call(alias):
    """The stock vision attention hands a function whose name contains `VARLEN_NAME_MARKER` the whole layer
    with its chunk boundaries (`VARLEN_BOUNDARIES`, `VARLEN_OTHERS`), and any other name one call per chunk."""
    from transformers.modeling_utils import AttentionInterface

    module = _vision_attention(alias)
    own, calls = object.__getattribute__(module.config, "__dict__"), []

    def record(module, query, key, value, attention_mask=None, **kwargs):
        calls.append((query.shape[2], set(kwargs)))
        return query.transpose(1, 2), None

    seq, chunks = 12, torch.tensor([0, 4, 12])
    hidden, rotary = torch.randn(seq, module.qkv.in_features), torch.zeros(seq, module.head_dim)
    saved = own[compat.ATTN_IMPLEMENTATION_FIELD]
    try:
        for name in (f"test_{compat.VARLEN_NAME_MARKER}_record", "test_plain_record"):
            AttentionInterface.register(name, record)
            own[compat.ATTN_IMPLEMENTATION_FIELD] = name
            module(hidden, chunks, (rotary, rotary), max_seqlen=8)
    finally:
        own[compat.ATTN_IMPLEMENTATION_FIELD] = saved
    varlen = {compat.VARLEN_BOUNDARIES, *compat.VARLEN_OTHERS}
    assert calls[0][0] == seq and varlen <= calls[0][1], _changed(compat.VARLEN_BOUNDARIES, f"one call: {calls[0]}")
    assert [n for n, _ in calls[1:]] == [4, 8] and not varlen & calls[1][1], _changed("flash", f"per chunk: {calls}")


def test_qwen_rope_index_takes_the_processors_grids():
    model = get_adapter("tiny-qwen2.5-vl").model
    expected = {"input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts"}
    assert expected <= set(_params(model.model.get_rope_index)), _changed("get_rope_index", "its arguments")
    ids = torch.tensor([[1, 2, 3]])
    positions, _ = compat.rope_index(model, ids, mm_token_type_ids=torch.zeros_like(ids))
    assert positions.shape == (3, 1, 3) and positions[:, 0].tolist() == [[0, 1, 2]] * 3, _changed("get_rope_index", "")


def test_the_cache_layer_base_is_what_the_compressible_layer_implements():
    base = compat.CacheLayerBase
    missing = set(base.__abstractmethods__) - set(vars(CompressibleLayer))
    assert not missing, _changed("CacheLayerMixin", f"new abstract methods {missing}")
    layer = CompressibleLayer()
    assert layer.keys is None and layer.values is None and layer.is_initialized is False, _changed(
        "CacheLayerMixin", "its __init__ state"
    )


def test_a_model_builds_from_a_config_and_a_tokenizer_names_its_tokens():
    from visualkv.models.synthetic.tiny import build_tiny_config, build_tiny_processor

    processor = build_tiny_processor("tiny-internvl3.5")
    config = build_tiny_config("tiny-internvl3.5", processor)
    model = compat.model_from_config(transformers.InternVLForConditionalGeneration, config)
    assert isinstance(model, transformers.InternVLForConditionalGeneration), _changed("_from_config", "")
    tokenizer = processor.tokenizer
    compat.set_special_token_names(tokenizer, {"context_image_token": "<IMG_CONTEXT>"})
    assert tokenizer.context_image_token == "<IMG_CONTEXT>", _changed("_set_model_specific_special_tokens", "")


def test_the_processor_helpers_keep_their_arguments():
    assert _params(compat.smart_resize)[:2] == ["height", "width"], _changed("qwen2_vl smart_resize", "")
    assert {"num_frames", "height", "width"} <= set(_params(compat.qwen3_smart_resize)), _changed(
        "qwen3_vl smart_resize", ""
    )
    assert len(_params(compat.get_optimal_tiled_canvas)) == 4, _changed("get_optimal_tiled_canvas", "")
    assert isinstance(compat.DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS, (set, list, tuple, dict)), _changed(
        "DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS", ""
    )


# -- nowhere else ------------------------------------------------------------------------------------------------------
def _code_tokens(text: str) -> list[tokenize.TokenInfo]:
    return [
        t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in (tokenize.NAME, tokenize.STRING)
    ]


def internal_uses(path: Path) -> list[str]:
    """`path`'s uses of a compat internal or of a private transformers / accelerate name ("line: name")."""
    text = path.read_text()
    found = []
    named = [i.name for i in compat.INTERNALS if re.fullmatch(r"\w+", i.name)]
    for token in _code_tokens(text):
        for name in named:
            quoted = re.search(rf"['\"]{name}['\"]", token.string)
            hit = token.string == name if token.type == tokenize.NAME else quoted is not None
            if hit:
                found.append(f"{token.start[0]}: {name}")
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    for pattern in ("sys.modules[",):
        found += [f"{code[: m.start()].count(chr(10)) + 1}: {pattern}" for m in re.finditer(re.escape(pattern), code)]
    imports = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom) and n.module]
    for node in imports:
        private = any(a.name.startswith("_") for a in node.names) and node.module.startswith(("transformers", "accel"))
        if node.module.startswith("transformers.models.") or private:
            found.append(f"{node.lineno}: from {node.module} import ...")
    return found


def _library_files() -> list[Path]:
    return [p for p in sorted(LIBRARY.rglob("*.py")) if p.name != "compat.py"]


def test_no_module_but_compat_uses_a_transformers_internal():
    uses = {str(p.relative_to(LIBRARY)): internal_uses(p) for p in _library_files()}
    uses = {path: found for path, found in uses.items() if found}
    assert not uses, f"transformers internals outside visualkv/models/compat.py: {uses}"


#: private names of other libraries the package reads (where each comes from)
OTHER_PRIVATE = {"_ArgumentGroup": "argparse", "_python_dispatch": "torch", "_pytree": "torch", "_unsafe_view": "torch"}


def test_no_module_reads_a_private_attribute_it_does_not_define():
    """A `._name` read outside compat that VisualKV does not define itself is another library's private name:
    transformers' or accelerate's belong in compat; another library's are listed in OTHER_PRIVATE."""
    ours, reads = set(), {}
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            private = isinstance(node, ast.Attribute) and re.match(r"_[^_]", node.attr)
            if private and path.name != "compat.py":
                reads.setdefault(node.attr, []).append(f"{path.relative_to(LIBRARY)}:{node.lineno}")
    foreign = {name: where for name, where in reads.items() if name not in ours and name not in OTHER_PRIVATE}
    assert not foreign, f"private names of another library outside visualkv/models/compat.py: {foreign}"


def test_the_grep_finds_each_kind_of_use(tmp_path):
    """The search itself: a planted use of each kind is found, the same text in a comment is not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import sys\n"
        "from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize\n"
        "x = config._attn_implementation  # _from_config in a comment is fine\n"
        "y = kwargs['cu_seq_lens_q'] if cls._from_config else None\n"
        "z = model.language_model.rotary_emb(h, p)\n"
        "f = sys.modules[type(m).__module__].eager_attention_forward\n"
    )
    found = internal_uses(planted)
    for expected in ("3: _attn_implementation", "5: rotary_emb", "6: eager_attention_forward", "6: sys.modules["):
        assert expected in found, (expected, found)
    assert any(f.startswith("2: from transformers.models.") for f in found)
    assert "4: cu_seq_lens_q" in found and "4: _from_config" in found
    assert not any(f.startswith("3: _from_config") for f in found)
