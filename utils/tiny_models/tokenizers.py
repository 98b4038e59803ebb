"""Offline construction of tiny tokenizers for the tiny test pipelines.

Nothing here touches the network: vocabularies are trained or enumerated in memory and handed to the
real transformers tokenizer classes, so the saved files load with the usual `from_pretrained`.
"""

from __future__ import annotations

import json
import re
from typing import Mapping, Sequence

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

# The Qwen pipelines wrap every prompt in these templates and then drop a fixed number of tokens from the
# front (`prompt_template_encode_start_idx`): the system turn plus "<|im_start|>user\n". Copied from
# diffusers 0.42 (pipeline_qwenimage*.py); the tests compare them with the loaded pipelines. How many
# tokens each drops is its family's fact (`TextTokens.template` in its spec): a family's tiny builder
# passes it to `build_qwen_tokenizer(drops=...)`, which checks the tiny vocabulary keeps it.
_EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n")
QWEN_EDIT_TEMPLATE = _EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
QWEN_EDIT_PLUS_TEMPLATE = _EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
# The tiny Qwen vocabulary is trained on these (in this order: the vocabulary, so every tiny model, depends on it).
QWEN_PROMPT_TEMPLATES: tuple[str, ...] = (QWEN_IMAGE_TEMPLATE, QWEN_EDIT_TEMPLATE, QWEN_EDIT_PLUS_TEMPLATE)
# Edit-Plus puts this before the prompt once per reference image.
QWEN_EDIT_PLUS_IMAGE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"

# Qwen3's chat template reduced to what ZImagePipeline uses: one user turn, the generation prompt, and the
# empty think block that `enable_thinking=False` adds (the pipeline passes True: no block).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# A chat template for the tiny [dev] tokenizer: Flux2Pipeline sends [system, user] turns whose content is a
# list of {"type": "text"} parts (Mistral-Small-3's own template renders them with [SYSTEM_PROMPT] / [INST]).
MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{% set parts = [message['content']] %}"
    "{% else %}{% set parts = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| list %}{% endif %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ parts | join('') }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ parts | join('') }}[/INST]{% endif %}{% endfor %}"
)

# Same order as the real Qwen2.5-VL vocabulary (there they start at id 151643).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip

# The Qwen2-VL chat template, so `apply_chat_template` works on the tiny processor as on the real one.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A little ordinary text besides the templates so typical prompts get a few real merges too.
_EXTRA_CORPUS = (
    "a photo of a cat sitting on a red chair, high quality, detailed",
    "make the sky blue and add a dog. Picture 1: Picture 2: Picture 3:",
    "0123456789 the a an in on with and of to is it",
)

_SPECIAL_RE = re.compile(r"<\|[a-z_]+\|>")


def template_prefix(template: str) -> str:
    """The part of a Qwen template that the pipeline drops: the system turn and '<|im_start|>user\\n'."""
    marker = "<|im_start|>user\n"
    return template[: template.index(marker) + len(marker)]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (fixed order, unlike ByteLevel.alphabet())."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def train_byte_level_bpe(corpus: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE with Qwen2's pre-tokenizer until every word of `corpus` is a single token.

    Special tokens are cut out of the corpus first: they are added to the tokenizer afterwards and
    never go through BPE.
    """
    texts = [piece for text in corpus for piece in _SPECIAL_RE.split(text) if piece]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # A vocab_size far above what the corpus can fill: training stops once no pair is left to merge.
    trainer = trainers.BpeTrainer(
        vocab_size=10_000,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=list(bytes_to_unicode().values()),
    )
    tokenizer.train_from_iterator(texts, trainer)
    vocab = dict(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))
    # The merges are only reachable through the JSON form of the trained model.
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return vocab, [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def build_qwen_tokenizer(templates: Sequence[str] = QWEN_PROMPT_TEMPLATES,
                         drops: Mapping[str, int] | None = None) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer trained on ``templates`` (the pipelines' prompt templates); where ``drops`` gives a
    template's drop length (its family's spec), its prefix is checked to encode to exactly that."""
    corpus = [*templates, QWEN_EDIT_PLUS_IMAGE_TEMPLATE, *_EXTRA_CORPUS]
    vocab, merges = train_byte_level_bpe(corpus)
    # Specials go at the end of the vocabulary in the real order, then get registered as special below.
    vocab.update({token: len(vocab) + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",  # as in Qwen2.5-VL-Instruct
        pad_token="<|endoftext|>",
        model_max_length=32768,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    check_qwen_template_drops(tokenizer, drops or {})
    return tokenizer


def check_qwen_template_drops(tokenizer, drops: Mapping[str, int]) -> None:
    """Raise unless each template's prefix encodes to exactly its drop length, whatever the prompt.

    The pipelines drop the first `drop` tokens of `template.format(prompt)`; with a wrong count they would
    drop part of the prompt or keep part of the system text.
    """
    for template, drop in drops.items():
        name = template_prefix(template)[:60].replace("\n", " ")
        prefix_ids = tokenizer(template_prefix(template))["input_ids"]
        if len(prefix_ids) != drop:
            raise AssertionError(f"{name!r}: template prefix encodes to {len(prefix_ids)} tokens, "
                                 f"pipeline drops {drop}")
        full_ids = tokenizer(template.format("A cat, 2 dogs."))["input_ids"]
        if full_ids[:drop] != prefix_ids:
            raise AssertionError(f"{name!r}: the prompt changes how the template prefix tokenizes")


def build_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIPTokenizer over the 256 byte characters and their '</w>' forms, with no merges."""
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={token: i for i, token in enumerate(tokens)}, merges=[], model_max_length=model_max_length
    )


def build_t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    """A T5 tokenizer from a small unigram vocabulary: single characters plus a few whole words.

    Built with the `tokenizers` Unigram model through transformers' T5Tokenizer, so no sentencepiece.
    """
    chars = [chr(c) for c in range(33, 127)]
    words = ["the", "a", "of", "and", "with", "photo", "cat", "dog", "red", "blue", "image", "on", "in"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -3.0) for w in words]
    vocab += [("▁" + c, -6.0) for c in chars] + [(c, -5.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, additional_special_tokens=[], model_max_length=model_max_length)
