"""A policy as a standard Hugging Face directory (config.json, model.safetensors, tokenizer files): a random
Qwen3 of the configured shape, a directory checked before anything loads it, and `load_policy`, the same
`from_pretrained` path that loads Qwen3-4B on a GPU node (the learner's; our engines hold the weights alone,
april_ray/engine/qwen3.py). The embedded model built from these, warmed up on
the task, is april_ray/task/embedded_model.py. torch and transformers are imported by the functions that
build or load a model, so that checking a model directory (where a job starts) stops a bad one before they load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from april_ray.config import ModelConfig


def build_random_model(cfg: ModelConfig, vocab_size: int, pad_id: int, eos_id: int, seed: int = 0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).float()


def check_model_dir(path: str | Path, key: str = "model.path") -> Path:
    """A Hugging Face model directory that can be loaded, or a ValueError naming the path and what is
    missing or corrupt: config.json (JSON, with model_type), the weights (safetensors, whole or sharded
    with every shard of its index present and a readable header) and the tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{key}: {path} {'is not a directory' if path.exists() else 'does not exist'}")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{key}: {path} has no config.json (not a Hugging Face model directory)") from None
    except ValueError as e:
        raise ValueError(f"{key}: {path / 'config.json'} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{key}: {path / 'config.json'} has no model_type")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{key}: {index} is corrupt ({e!r})") from None
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ValueError(f"{key}: {path} has no weights (model.safetensors or model.safetensors.index.json)")
    for shard in shards:
        _check_safetensors(path / shard, key)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"{key}: {path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return path


def _check_safetensors(file: Path, key: str) -> None:
    """The header is read and every tensor's byte range checked against the file size (cheap: no data read;
    opened for numpy, which loads nothing here either, so that the driver's check does not import torch)."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise ValueError(f"{key}: weight file {file} is missing")
    try:
        with safe_open(str(file), "np") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{key}: {file} is not a readable safetensors file ({e})") from None


def load_policy(path: str | Path, dtype=None):
    """The model (float32 unless `dtype` says otherwise) in eval mode, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
