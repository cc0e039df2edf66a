"""A character-level tokenizer built locally with `tokenizers`, saved as a standard HF tokenizer.

One id per printable ASCII character, so any prompt (the countdown task, or a math problem) round-trips.
It loads through `AutoTokenizer.from_pretrained(path)`, the same call that loads Qwen3's tokenizer.

Its chat template renders a lone user turn as its bare text, so the countdown's prompt ids are the same
through the template (`task.apply_chat_template`, on by default) as without it: the warm-up, the
benchmarks and the simulator's calibration (which encode raw prompt text) see what training sees. A
system turn comes first, ended by a newline; an assistant turn ends with the end-of-sequence token.
"""
from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] + eos_token }}"
    "{%- else -%}{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    )


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""The tokenizer classes that only wrap a tokenizer.json; AutoTokenizer resolves a Qwen3 directory naming one
of them (this module's tokenizer, saved) to `TokenizersBackend`."""


def load_tokenizer(path):
    """`AutoTokenizer.from_pretrained(path)`. A Qwen3 directory whose tokenizer_config.json names a generic
    class (and no code of its own) is loaded by `PreTrainedTokenizerFast` directly, the class AutoTokenizer
    resolves it to: AutoTokenizer's own import loads torch (through transformers' configuration module),
    which the driver and the prompt source, that tokenize but never run a model, have no other use for."""
    import json
    from pathlib import Path

    directory = Path(path)
    try:
        tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        tok_cfg, model_type = {}, None
    if tok_cfg.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in tok_cfg and model_type == "qwen3":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
