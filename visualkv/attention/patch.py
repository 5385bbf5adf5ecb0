"""`patched(adapter)`: the one scoped context through which VisualKV changes a transformers model.

Inside it the decoder's attention configs name VisualKV's functions (`packed.WRAPPED`) and the Qwen vision towers'
configs name their one-call form (`vision.WRAPPED`, active in the entering thread only); no module's `forward`
is replaced. A model left in training mode runs as in eval
mode in the entering thread only (`_NoDropout`): no module's `training` flag changes, so another thread using the
model meanwhile still trains it. The outermost entry makes these changes and its exit (normal, on error, on Stop) puts every attribute back
exactly as it was; nested entries only count. State lives here, per model (a lock, a depth, what was saved), never
on the model, and threads serving several chats from one model share one patch.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from visualkv.attention import packed as packed_attention
from visualkv.attention import vision
from visualkv.models import compat

_ABSENT = object()  # an attribute that was not in the object's own namespace before the patch
_INTERNAL = compat.ATTN_IMPLEMENTATION_FIELD  # what transformers' `config._attn_implementation` property reads


def _namespace(obj: Any) -> dict:
    """`obj`'s own attribute dict, read past any `__getattribute__` override (transformers' configs have a slow one)."""
    return object.__getattribute__(obj, "__dict__")


class _Patch:
    """One model's patch: the namespaces to change (found once), the entry depth, and what was saved on entry.

    Entering and leaving are a few dict operations per changed attribute: cheap enough for every decode step.
    """

    def __init__(self, model: torch.nn.Module, decoder_configs: list[Any]) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.model = weakref.ref(model)  # a value of `_PATCHES` must not keep its key alive
        self.config_namespaces = [_namespace(c) for c in decoder_configs]
        towers = {id(m.config): m.config for m in vision.vision_attention_modules(model)}
        self.vision_namespaces = [_namespace(c) for c in towers.values()]
        self.implementation: str | None = None  # the decoder's own attention while entered
        self.saved: list[tuple[dict, str]] = []  # (namespace, attribute) this patch holds overridden, in order

    def apply(self) -> None:
        for own in self.config_namespaces:
            name = own.get(_INTERNAL) or "sdpa"
            if self.implementation is None:  # the text config's, first
                self.implementation = name
            if name in packed_attention.WRAPPED:  # set directly: the property's setter would touch sub-configs
                self._set(own, _INTERNAL, packed_attention.WRAPPED[name])
        for own in self.vision_namespaces:
            name = own.get(_INTERNAL) or "eager"  # transformers' vision attention defaults to eager
            name = vision.BASE_OF.get(name, name)  # named already by another patch of the same tower
            if name in vision.WRAPPED:  # flash attention already attends in one call
                self._set(own, _INTERNAL, vision.WRAPPED[name])

    def _set(self, own: dict, name: str, value: Any) -> None:
        _override(own, name, value)
        self.saved.append((own, name))

    def restore(self) -> None:
        while self.saved:  # last change first
            _release(*self.saved.pop())
        self.implementation = None


#: (id of a namespace, attribute) -> [the namespace, how many patches hold the override, the value before]
_OVERRIDES: dict[tuple[int, str], list] = {}
_OVERRIDES_LOCK = threading.Lock()


def _override(own: dict, name: str, value: Any) -> None:
    """Set `own[name]` unless another patch already overrides it (a model's patch and its tower's share
    modules); the value before the first override is kept until the last holder releases it."""
    with _OVERRIDES_LOCK:
        held = _OVERRIDES.get((id(own), name))
        if held is not None:
            held[1] += 1
            return
        _OVERRIDES[(id(own), name)] = [own, 1, own.get(name, _ABSENT)]
        own[name] = value


def _release(own: dict, name: str) -> None:
    """Drop one hold of an override; the last one puts back the value from before the first."""
    with _OVERRIDES_LOCK:
        held = _OVERRIDES[(id(own), name)]
        held[1] -= 1
        if held[1]:
            return
        del _OVERRIDES[(id(own), name)]
        if held[2] is _ABSENT:
            own.pop(name, None)
        else:
            own[name] = held[2]


_PATCHES: weakref.WeakKeyDictionary[torch.nn.Module, _Patch] = weakref.WeakKeyDictionary()
_REGISTRY = threading.Lock()


def _model_and_configs(target: Any) -> tuple[torch.nn.Module, list[Any]]:
    """(the model, the configs its decoder's attention modules read, deduplicated by identity) of an adapter;
    (the module, []) of a bare module (its vision towers only)."""
    if isinstance(target, torch.nn.Module):
        return target, []
    attentions = [getattr(layer, "self_attn", None) for layer in target.layers]
    configs = [target.text_config, *(getattr(attention, "config", None) for attention in attentions)]
    unique = {id(c): c for c in configs if c is not None}
    return target.model, list(unique.values())


def _patch_of(target: Any) -> _Patch:
    model = target if isinstance(target, torch.nn.Module) else target.model
    with _REGISTRY:
        patch = _PATCHES.get(model)
        if patch is None:
            patch = _PATCHES[model] = _Patch(*_model_and_configs(target))
        return patch


@contextlib.contextmanager
def patched(target: Any) -> Iterator[None]:
    """Within the block, `target` (a `ModelAdapter`, or a bare module such as a vision tower) runs VisualKV's
    attention; on leaving the outermost block the model is exactly as before."""
    patch = _patch_of(target)
    entered = False
    model = patch.model()
    no_dropout = _NoDropout() if model is not None and model.training else contextlib.nullcontext()
    try:
        with patch.lock:
            if patch.depth == 0:
                try:
                    patch.apply()
                except BaseException:
                    patch.restore()
                    raise
            patch.depth += 1
            entered = True
        with no_dropout, vision.one_call_in_this_thread():
            yield
    finally:
        if entered:
            with patch.lock:
                patch.depth -= 1
                if patch.depth == 0:
                    patch.restore()


#: the dropout functions a module in training mode calls (`nn.Dropout` and transformers' attention call these)
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}


class _NoDropout(TorchFunctionMode):
    """Eval mode's dropout in the thread that enters it (torch function modes are per thread): every dropout
    returns its input and attention kernels get `dropout_p=0`, whatever the modules' `training` flags say."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


def implementation(adapter: Any) -> str:
    """The decoder's own attention implementation ("sdpa", "eager", "flash_attention_2", ...), also while
    `patched` has it name VisualKV's functions."""
    patch = _PATCHES.get(adapter.model)
    if patch is not None:
        with patch.lock:
            if patch.depth and patch.implementation is not None:
                return patch.implementation
    return adapter.attn_implementation
