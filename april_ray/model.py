"""The embedded default policy: a tiny Qwen3 built locally and warmed up on the countdown task.

It is saved as a standard Hugging Face directory (config.json, model.safetensors, tokenizer files) and
loaded by `load_policy`, the same `from_pretrained` path that loads Qwen3-4B on a GPU node. Nothing is
ever downloaded. The directory name hashes every setting that shapes the weights, so a second run with
the same config reuses it and a changed config builds a new one. torch and transformers are imported
by the functions that build or load a model, so that checking a model directory (where a job starts)
stops a bad one before they load.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from april_ray.batching import padded_chunks
from april_ray.config import Config, ModelConfig
from april_ray.task import lookup_countdown
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.tokenizer import CHAT_TEMPLATE, build_tokenizer


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


def embedded_model_dir(cfg: Config) -> Path:
    key = json.dumps(
        {"model": {k: v for k, v in asdict(cfg.model).items() if k not in ("path", "cache_dir")},
         "warmup": {k: v for k, v in asdict(cfg.warmup).items() if k != "num_threads"},
         "task": {"length": asdict(cfg.task.length), "seed": cfg.task.seed, "n": cfg.task.num_train,
                  "max_step": cfg.task.max_step} | ({} if cfg.task.name == "countdown" else {"name": cfg.task.name, "format": lookup_countdown.FORMAT}),
         "chat_template": CHAT_TEMPLATE},
        sort_keys=True,
    )
    return Path(cfg.model.cache_dir) / "models" / f"tiny-qwen3-countdown-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


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
    """The header is read and every tensor's byte range checked against the file size (cheap: no data read)."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise ValueError(f"{key}: weight file {file} is missing")
    try:
        with safe_open(str(file), "pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{key}: {file} is not a readable safetensors file ({e})") from None


def ensure_model(cfg: Config, log=print) -> Path:
    """The policy directory: `model.path` if set (checked: `check_model_dir`), else the embedded model
    (built on first use)."""
    if cfg.model.path:
        return check_model_dir(cfg.model.path)
    out = embedded_model_dir(cfg)
    if (out / "model.safetensors").is_file():
        return check_model_dir(out, f"the embedded model (delete {out} to rebuild it)")
    log(f"building the embedded tiny model into {out} (one-time warm-up, cached afterwards)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))  # this build's own: jobs may build at once
    tokenizer = build_tokenizer()
    model = build_random_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id,
                               cfg.warmup.seed)
    train_path, _ = dataset_paths(cfg.task, cfg.model.cache_dir)
    warmup(model, tokenizer, read_examples(train_path), cfg, log)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.replace(out)  # atomic: a crash mid-build never leaves a half-written model behind
    except OSError:  # another job's build of the same model took the place first: the same weights
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_policy(path: str | Path, dtype=None):
    """The model (float32 unless `dtype` says otherwise) in eval mode, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def _sequence(tokenizer, ex, task_name: str) -> tuple[list[int], list[int]]:
    """(ids, labels) of prompt + answer + EOS: the loss on the model's tokens only (not on the prompt, nor on
    the environment's tokens of an agent task's transcript)."""
    prompt = tokenizer.encode(ex.prompt)
    parts = lookup_countdown.segments(ex.prompt) if task_name == "lookup_countdown" else [(ex.answer, True)]
    ids, labels = list(prompt), [-100] * len(prompt)
    for text, trained in parts:
        part = tokenizer.encode(text)
        ids += part
        labels += part if trained else [-100] * len(part)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def _collate(seqs, idx, pad_id):
    import torch

    width = max(len(seqs[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad_id)
    labels = torch.full((len(idx), width), -100)
    for row, i in enumerate(idx):
        toks, targets = seqs[i]
        ids[row, : len(toks)] = torch.tensor(toks)
        labels[row, : len(toks)] = torch.tensor(targets)
    return ids, labels


def warmup(model, tokenizer, examples, cfg: Config, log=print) -> None:
    """Supervised fine-tuning on prompt+answer (loss on the answer), cosine schedule, deterministic per seed."""
    import torch

    w = cfg.warmup
    torch.manual_seed(w.seed)
    torch.set_num_threads(w.num_threads)
    rng = random.Random(w.seed)
    seqs = [_sequence(tokenizer, ex, cfg.task.name) for ex in examples]
    batches = padded_chunks([len(toks) for toks, _ in seqs], w.batch_size * 64)
    rng.shuffle(batches)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    t0 = time.perf_counter()
    for step in range(w.steps):
        lr = w.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / max(1, w.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = _collate(seqs, batches[step % len(batches)], tokenizer.pad_token_id)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == w.steps - 1:
            log(f"warm-up step {step}/{w.steps} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
