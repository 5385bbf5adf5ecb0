"""Offline, deterministic tokenizers for the tiny random-weight VLMs.

Nothing here downloads anything. A byte-level BPE is trained in-process with the
``tokenizers`` library on a small corpus generated from a fixed seed, then wrapped in
the transformers tokenizer class a real checkpoint loads as in transformers 5
(``Qwen2Tokenizer`` for the Qwen-LLM families, the generic ``TokenizersBackend`` for SmolVLM2)
together with every special token that the family's processor and chat template rely on.

Because the alphabet is the 256 byte-level symbols, every string round-trips
(``decode(encode(s)) == s``).
"""

from __future__ import annotations

import functools
import json
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

__all__ = [
    "QWEN_CHAT_TEMPLATE",
    "QWEN_SPECIAL_TOKENS",
    "SMOLVLM_ADDED_SPECIAL_TOKENS",
    "SMOLVLM_CHAT_TEMPLATE",
    "SMOLVLM_LEADING_SPECIAL_TOKENS",
    "build_qwen_tokenizer",
    "build_smolvlm_tokenizer",
    "qwen_generation_ids",
    "set_qwen_text_ids",
    "train_bpe",
]

# Split regex of the Qwen2 tokenizer (same as transformers' ``Qwen2Tokenizer``).
_QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Special tokens of Qwen2.5-VL, in the order of the released tokenizer (ids 151643...151656 there).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Chat template of Qwen/Qwen2.5-VL-*-Instruct (chat_template.json of the released checkpoints).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# SmolLM2 keeps its control tokens at the very start of the vocabulary (ids 0, 1, 2).
SMOLVLM_LEADING_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
)

# Tokens SmolVLM adds on top of SmolLM2 (appended after the BPE vocabulary).
SMOLVLM_ADDED_SPECIAL_TOKENS: tuple[str, ...] = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
    "<end_of_utterance>",
)

# Chat template of HuggingFaceTB/SmolVLM2-*-Instruct, in the form transformers' SmolVLMProcessor
# uses for videos (``processing_smolvlm.DEFAULT_CHAT_TEMPLATE``): the released one plus a video branch.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

_WORDS_TEXT = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place made "
    "live where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father "
    "image video frame token cache model vision language attention layer head key value query pixel "
    "describe color red green blue black white left top bottom center object person car dog cat tree "
    "sky road building text table chart screen window photo scene count what where which how many "
    "Assistant User System Image Video Frame The A This There What How Describe Answer Question"
)
_WORDS = _WORDS_TEXT.split()
_PUNCT = (
    ".",
    ",",
    "?",
    "!",
    ":",
    ";",
    "'",
    '"',
    "(",
    ")",
    "-",
    "/",
    "%",
    "$",
    "#",
    "@",
    "&",
    "*",
)


def _corpus(seed: int = 1234, n_sentences: int = 3000) -> list[str]:
    """Generate a deterministic English-like corpus with digits and punctuation."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_sentences):
        n = rng.randint(4, 16)
        parts: list[str] = []
        for _ in range(n):
            r = rng.random()
            if r < 0.8:
                parts.append(rng.choice(_WORDS))
            elif r < 0.92:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 4))))
            else:
                parts.append(rng.choice(_WORDS) + rng.choice(_PUNCT))
        sentence = " ".join(parts)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice((".", "?", "!", ".\n", ":\n")))
    return lines


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    """Return the pre-tokenizer the family's transformers tokenizer class builds."""
    if family == "qwen2_5_vl":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    # SmolLM2's tokenizer.json: single digits, then GPT-2 style byte-level splitting.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def train_bpe(
    family: str, vocab_size: int, leading_special: tuple[str, ...] = ()
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE on the built-in corpus (uncached; deterministic).

    Args:
        family: ``"qwen2_5_vl"`` or ``"smolvlm"`` (selects the pre-tokenizer).
        vocab_size: Target size of the BPE vocabulary, including the 256 byte symbols and
            ``leading_special``.
        leading_special: Special tokens placed first in the vocabulary (ids 0..k-1).

    Returns:
        ``(vocab, merges)`` for a ``tokenizers`` BPE model / ``Qwen2Tokenizer``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(leading_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    vocab = dict(sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]))
    # Merges are not exposed directly: read them back from the serialized model.
    merges_raw = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges_raw]
    return vocab, merges


@functools.lru_cache(maxsize=8)
def _cached_bpe(
    family: str, vocab_size: int, leading_special: tuple[str, ...]
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    vocab, merges = train_bpe(family, vocab_size, leading_special)
    return tuple(vocab.items()), tuple(merges)


def build_qwen_tokenizer(bpe_vocab_size: int = 1024) -> Qwen2Tokenizer:
    """Build a ``Qwen2Tokenizer`` with Qwen2.5-VL's special tokens and chat template.

    The special tokens get the ids right after the BPE vocabulary, in the released order
    (``<|endoftext|>`` first, ``<|video_pad|>`` last), so ``len(tokenizer) ==
    bpe_vocab_size + 14``.
    """
    vocab_items, merges = _cached_bpe("qwen2_5_vl", bpe_vocab_size, ())
    vocab = dict(vocab_items)
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=list(merges),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=131072,
        split_special_tokens=False,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS),
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def qwen_generation_ids(tokenizer) -> tuple[int, list[int], int]:
    """(bos, eos, pad) of a Qwen-LLM chat model's generation config: a turn ends at <|im_end|> or <|endoftext|>."""
    ids = tokenizer.convert_tokens_to_ids
    return ids("<|endoftext|>"), [ids("<|im_end|>"), ids("<|endoftext|>")], ids("<|endoftext|>")


def set_qwen_text_ids(text_config, tokenizer) -> None:
    """Give a released Qwen-LLM text config the offline tokenizer's bos / eos / pad (same tokens, other ids)."""
    ids = tokenizer.convert_tokens_to_ids
    text_config.bos_token_id = ids("<|endoftext|>")
    text_config.eos_token_id = ids("<|im_end|>")
    text_config.pad_token_id = ids("<|endoftext|>")


def build_smolvlm_tokenizer(bpe_vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Build SmolVLM2's tokenizer: a generic ``TokenizersBackend`` over a byte-level BPE.

    transformers 5 loads SmolVLM checkpoints' tokenizers as the generic
    ``TokenizersBackend`` (alias ``PreTrainedTokenizerFast``) whatever their
    ``tokenizer_class`` says, so the tiny model uses that class too.

    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` take ids 0, 1, 2 (as in SmolLM2);
    SmolVLM's image/row-col/end-of-utterance tokens follow the BPE vocabulary.
    bos = ``<|im_start|>``, eos = ``<end_of_utterance>``, pad = ``<|im_end|>``,
    unk = ``<|endoftext|>`` like the released tokenizer.
    """
    vocab_items, merges = _cached_bpe("smolvlm", bpe_vocab_size, SMOLVLM_LEADING_SPECIAL_TOKENS)
    vocab = dict(vocab_items)
    for token in SMOLVLM_ADDED_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer("smolvlm")
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        add_prefix_space=False,
        model_max_length=8192,
        extra_special_tokens=[
            *SMOLVLM_LEADING_SPECIAL_TOKENS,
            *SMOLVLM_ADDED_SPECIAL_TOKENS,
        ],
    )
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tokenizer
