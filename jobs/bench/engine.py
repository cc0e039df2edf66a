"""Engine speed: saturated decode throughput vs `model.generate`, and throughput by concurrency.

    python -m jobs.bench.engine --json PATH [--threads N] [--task-seconds S] [key=value ...]

Both sides sample 128 new tokens for each of the same 64 prompts (temperature 1, no stop token), with
the same torch thread count, interleaved over `--repeats` rounds; the median of each is reported.
`task_mix_tok_s` is the engine on the task's own length mix instead: `engine.max_num_seqs` requests
always running, each finished one replaced at once (real stop token and response budget), counted over
`--task-seconds` after a warm-up (the rollout benchmark's ceiling, without Ray).
"""
from __future__ import annotations

import asyncio
import statistics
import time

import torch

from jobs.common import parse, write_result
from april_ray.engine.async_engine import AsyncEngine
from april_ray.engine.cpu_engine import LLMEngine
from april_ray.engine.probe import saturated_throughput
from april_ray.model import load_policy
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.embedded_model import ensure_model
from april_ray.types import GenerateRequest, SamplingParams

NEW_TOKENS = 128
BATCH = 64
CURVE = (1, 4, 16, 64, 256)


def engine_tok_s(model, prompts: list[list[int]], concurrency: int, max_model_len: int) -> float:
    engine = LLMEngine(model, max_num_seqs=concurrency, max_model_len=max_model_len)
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    reqs = [GenerateRequest(str(i), p, sp) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    return sum(o.num_tokens for o in outs) / (time.perf_counter() - t0)


def task_mix_tok_s(model, prompts: list[list[int]], sampling: SamplingParams, concurrency: int,
                   max_model_len: int, seconds: float, warmup_s: float = 1.0) -> tuple[float, float]:
    """(tokens/s, mean running rows per step) over `seconds` after `warmup_s`: the engine actor's ceiling
    probe (`april_ray/engine/probe.py`), on an engine of its own."""
    engine = AsyncEngine(LLMEngine(model, max_num_seqs=concurrency, max_model_len=max_model_len))
    tokens, dt, rows, _ = asyncio.run(saturated_throughput(engine, prompts, sampling, concurrency, seconds, warmup_s))
    return tokens / dt, rows


def hf_generate_tok_s(model, tok, prompts: list[list[int]]) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=tok.pad_token_id)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - t0)


def hf_continuous_batching_tok_s(model, tok, prompts: list[list[int]]) -> float:
    """transformers' own continuous batching (`generate_batch`), the alternative we did not build on."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0,  # top_k=0 fails there
                           eos_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=cfg, progress_bar=False)  # fails under inference_mode
    return sum(len(o.generated_tokens) for o in outs.values()) / (time.perf_counter() - t0)


def main() -> None:
    def extra(p):
        p.add_argument("--json", required=True, help="where to write the figures")
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: engine.num_threads)")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--task-seconds", type=float, default=5.0, help="length of one task-mix measurement")

    cfg, args = parse(__doc__, extra)
    threads = args.threads or cfg.engine.num_threads
    torch.set_num_threads(threads)
    model, tok = load_policy(ensure_model(cfg))
    _, eval_path = dataset_paths(cfg.task, cfg.model.cache_dir)
    pool = [tok.encode(ex.prompt) for ex in read_examples(eval_path)]
    prompts = [pool[i % len(pool)] for i in range(max(CURVE))]
    max_len = max(map(len, prompts)) + NEW_TOKENS + 1

    task_sampling = SamplingParams(temperature=cfg.sampling.temperature, max_new_tokens=cfg.sampling.max_response_len,
                                   stop_token_ids=(tok.eos_token_id,))
    task_len = max(map(len, pool)) + cfg.sampling.max_response_len + 1
    engine_runs, hf_runs, task_runs = [], [], []
    for _ in range(args.repeats):
        engine_runs.append(engine_tok_s(model, prompts[:BATCH], BATCH, max_len))
        hf_runs.append(hf_generate_tok_s(model, tok, prompts[:BATCH]))
        task_runs.append(task_mix_tok_s(model, pool, task_sampling, cfg.engine.max_num_seqs, task_len,
                                        args.task_seconds)[0])
    try:
        hf_cb = round(hf_continuous_batching_tok_s(model, tok, prompts[:BATCH]), 1)
    except Exception as e:  # recorded, not hidden: the comparison is part of the engine choice
        hf_cb = f"failed: {type(e).__name__}: {e}"
    curve = {c: round(engine_tok_s(model, prompts[:max(c, 4)], c, max_len), 1) for c in CURVE}
    engine_med, hf_med = statistics.median(engine_runs), statistics.median(hf_runs)
    result = {
        "engine_tok_s": round(engine_med, 1), "hf_generate_tok_s": round(hf_med, 1),
        "ratio": round(engine_med / hf_med, 3), "curve": curve,
        "task_mix_tok_s": round(statistics.median(task_runs), 1), "task_mix_runs": [round(x, 1) for x in task_runs],
        "hf_continuous_batching_tok_s": hf_cb,
        "engine_runs": [round(x, 1) for x in engine_runs], "hf_generate_runs": [round(x, 1) for x in hf_runs],
        "setup": {"batch": BATCH, "new_tokens": NEW_TOKENS, "threads": threads,
                  "task_mix": {"concurrency": cfg.engine.max_num_seqs, "max_new_tokens": cfg.sampling.max_response_len,
                               "seconds": args.task_seconds},
                  "params": sum(p.numel() for p in model.parameters())},
    }
    write_result(args.json, result)


if __name__ == "__main__":
    main()
