"""The embedded default policy: a tiny Qwen3 built locally and warmed up on the configured task.

Nothing is ever downloaded. The directory name hashes every setting that shapes the weights, so a second
run with the same config reuses it and a changed config builds a new one. The task (`registry.Task`) says
what it adds to that key and which text of its answers the warm-up trains on.
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
from typing import TYPE_CHECKING

from april_ray.batching import padded_chunks
from april_ray.model import build_random_model, check_model_dir
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.registry import Task, get_task
from april_ray.task.tokenizer import CHAT_TEMPLATE, build_tokenizer

if TYPE_CHECKING:
    from april_ray.config import Config, WarmupConfig


def embedded_model_dir(cfg: Config) -> Path:
    data = {"length": asdict(cfg.task.length), "seed": cfg.task.seed, "n": cfg.task.num_train,
            "max_step": cfg.task.max_step}
    key = json.dumps(
        {"model": {k: v for k, v in asdict(cfg.model).items() if k not in ("path", "cache_dir")},
         "warmup": {k: v for k, v in asdict(cfg.warmup).items() if k != "num_threads"},
         "task": data | get_task(cfg.task.name).model_key(cfg.task),
         "chat_template": CHAT_TEMPLATE},
        sort_keys=True,
    )
    return Path(cfg.model.cache_dir) / "models" / f"tiny-qwen3-countdown-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


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
    warmup(model, tokenizer, read_examples(train_path), get_task(cfg.task.name), cfg.warmup, log)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.replace(out)  # atomic: a crash mid-build never leaves a half-written model behind
    except OSError:  # another job's build of the same model took the place first: the same weights
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _sequence(tokenizer, ex, task: Task) -> tuple[list[int], list[int]]:
    """(ids, labels) of prompt + answer + EOS: the loss on the task's trained segments only (not on the
    prompt, nor on the environment's tokens of an agent task's transcript)."""
    prompt = tokenizer.encode(ex.prompt)
    ids, labels = list(prompt), [-100] * len(prompt)
    for text, trained in task.warmup_segments(ex):
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


def warmup(model, tokenizer, examples, task: Task, w: WarmupConfig, log=print) -> None:
    """Supervised fine-tuning on prompt+answer (loss on the task's trained segments), cosine schedule,
    deterministic per seed."""
    import torch

    torch.manual_seed(w.seed)
    torch.set_num_threads(w.num_threads)
    rng = random.Random(w.seed)
    seqs = [_sequence(tokenizer, ex, task) for ex in examples]
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
