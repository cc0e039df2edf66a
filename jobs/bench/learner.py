"""One learner step at the paper's vocabulary: tokens/s and peak memory, each memory option on and off, and
the memory plan against what was measured.

    python -m jobs.bench.learner --json PATH [--shapes 10M,50M] [--tokens 2048,8192] [--threads N] [--options ...]

Random-init Qwen3 models with Qwen3's 151,936-token vocabulary (what makes the logits large) and about 10M
and 50M parameters besides the embedding, one micro-batch of `--tokens` tokens (4 samples, 16-token
prompts), the torch backend in fp32 on CPU. Each measurement runs in a process of its own: a small step
first (the optimiser's states exist from then on), then the measured step; its peak is the process's peak
resident memory during that step (VmHWM, reset before it) over what the process held before the learner
was built. Every shape and length runs with checkpointing and chunked log-probs on; the first shape at
the first length also runs each option alone and both off (whole logits: 8k tokens would need ~25 GB),
and packed; bf16 (autocast) only on a GPU by default (one CPU step took over 14 minutes).
On a shared machine wall time depends on the neighbours: `tokens_per_cpu_s` (tokens over the step's
process CPU time, all threads) is the steadier figure. Keys: `checkpointing_peak_ratio` (peak with both
options over peak with neither), `grad_rel_diff` (largest relative difference, per weight tensor, of the
step's gradient between the two, fp32), `plan_rel_err` (largest relative error of the plan's peak against a
measured one), `runs` (every measurement).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs.common import write_result

VOCAB = 151_936
SHAPES = {  # name: (hidden, layers, heads, kv heads, head dim, intermediate)
    "10M": (256, 12, 4, 2, 64, 768),
    "50M": (512, 16, 8, 4, 64, 1536),
    "tiny": (64, 2, 4, 2, 16, 128),  # tests only
}
OPTIONS = {  # name: (gradient_checkpointing, logprob_chunk_tokens, packing, dtype)
    "both_off": (False, 0, "off", "float32"),
    "checkpointing": (True, 0, "off", "float32"),
    "chunked": (False, 1024, "off", "float32"),
    "both_on": (True, 1024, "off", "float32"),
    "both_on_packed": (True, 1024, "on", "float32"),
    "both_on_bf16": (True, 1024, "off", "bfloat16"),
}
ROWS, PROMPT = 4, 16


def shape(name: str, vocab: int = VOCAB):
    from april_ray.learn.plan import Shape

    h, layers, heads, kv, hd, inter = SHAPES[name]
    return Shape(vocab, h, layers, heads, kv, hd, inter, tied=True)


def build_model_dir(name: str, vocab: int, out: Path) -> Path:
    """A random-init Qwen3 of the named shape and a tokenizer (only its pad id matters here)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from april_ray.task.tokenizer import build_tokenizer

    s = shape(name, vocab)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                         num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                         intermediate_size=s.intermediate_size, max_position_embeddings=16384, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).float().save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def samples(tokens: int, vocab: int, rows: int = ROWS, seed: int = 0) -> list:
    """`rows` samples of one group, `tokens` in all (16-token prompts), rewards alternating."""
    import random

    from april_ray.types import FinishReason, Sample, SampleState

    rng, n = random.Random(seed), tokens // rows
    out = []
    for i in range(rows):
        response = [rng.randrange(3, vocab) for _ in range(n - PROMPT)]
        out.append(Sample(f"g/{i}", "g", "p", "a", [rng.randrange(3, vocab) for _ in range(PROMPT)], n,
                          response_ids=response, logprobs=[-12.0] * len(response), versions=[0] * len(response),
                          state=SampleState.FINISHED, finish_reason=FinishReason.STOP, reward=float(i % 2)))
    return out


def learner_for(model_dir: Path, option: str, tokens: int, threads: int):
    from april_ray.config import AlgorithmConfig, LearnerConfig
    from april_ray.learn.learner import Learner

    ckpt, chunk, packing, dtype = OPTIONS[option]
    cfg = LearnerConfig(backend="torch", micro_batch_tokens=tokens, max_spread=1e9, gradient_checkpointing=ckpt,
                        logprob_chunk_tokens=chunk, packing=packing, dtype=dtype, num_threads=threads)
    return Learner(str(model_dir), cfg, AlgorithmConfig(), temperature=1.0, max_response_len=tokens)


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_here(model_dir: Path, option: str, tokens: int, vocab: int, threads: int) -> dict:
    """Peak bytes and seconds of one learner step, in this process (a fresh one: the peak is the process's).

    The peak is what the step added to the process's resident memory at its highest (VmHWM over VmRSS
    before it) plus the tensors the learner holds between steps (weights and optimiser states, by their
    sizes): the process's own baseline (libraries, the loaded file's pages) is left out."""
    learner = learner_for(model_dir, option, tokens, threads)
    learner.train_step(samples(4 * (PROMPT + 4), vocab, seed=1), version=0)  # the optimiser's states now exist
    batch = samples(tokens, vocab)
    held = sum(t.numel() * t.element_size() for t in learner.module.parameters())
    held += sum(t.numel() * t.element_size() for state in learner.optimizer.state.values() for t in state.values()
                if hasattr(t, "numel") and t.dim() > 0)
    if learner.device.type == "cuda":  # the allocator's own peak: what the plan is about
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0, cpu0 = time.perf_counter(), time.process_time()
        learner.train_step(batch, version=0)
        torch.cuda.synchronize()
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        return {"peak_bytes": torch.cuda.max_memory_allocated(), "step_s": seconds, "cpu_s": cpu_s,
                "tokens_per_s": tokens / seconds}
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0, cpu0 = time.perf_counter(), time.process_time()
    learner.train_step(batch, version=0)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    step = _rss("VmHWM") - before
    return {"peak_bytes": step + held, "step_bytes": step, "held_bytes": held, "step_s": seconds, "cpu_s": cpu_s,
            "tokens_per_s": tokens / seconds}


def gradients_here(model_dir: Path, tokens: int, vocab: int, threads: int) -> float:
    """Largest relative difference (per weight tensor, L2) of one step's gradient: both options off vs on."""
    import torch

    grads = []
    for option in ("both_off", "both_on"):
        learner = learner_for(model_dir, option, tokens, threads)
        captured = {}

        def capture(learner=learner, captured=captured):
            captured.update({n: p.grad.clone() for n, p in learner.module.named_parameters() if p.grad is not None})
            learner.optimizer.zero_grad(set_to_none=True)
            return 0.0

        learner.optim.step = capture
        learner.train_step(samples(tokens, vocab), version=0)
        grads.append(captured)
        del learner
    off, on = grads
    return max(float(torch.linalg.vector_norm(on[k] - g) / torch.linalg.vector_norm(g).clamp(min=1e-30))
               for k, g in off.items())


def in_subprocess(kind: str, **kwargs) -> dict | float:
    """A measurement in a process of its own (its peak memory is its own)."""
    cmd = [sys.executable, "-m", "jobs.bench.learner", "--one", json.dumps({"kind": kind} | kwargs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def predicted_bytes(name: str, vocab: int, option: str, tokens: int) -> float:
    from april_ray.learn.plan import LearnerSetting, learner_parts

    ckpt, chunk, _, dtype = OPTIONS[option]
    setting = LearnerSetting(2 if dtype == "bfloat16" else 4, "torch", 0, 1, tokens, chunk, ckpt)
    return sum(learner_parts(shape(name, vocab), setting).values())


def run(shapes: list[str], lengths: list[int], vocab: int, threads: int, work: Path,
        options_at_first=tuple(OPTIONS)) -> dict:
    runs = []
    for i, name in enumerate(shapes):
        model_dir = build_model_dir(name, vocab, work / name)
        for j, tokens in enumerate(lengths):
            for option in (options_at_first if i == j == 0 else ("both_on",)):
                got = in_subprocess("measure", model_dir=str(model_dir), option=option, tokens=tokens, vocab=vocab,
                                    threads=threads)
                plan = predicted_bytes(name, vocab, option, tokens)
                row = {"shape": name, "params": shape(name, vocab).num_params, "tokens": tokens, "option": option,
                       "tokens_per_s": round(got["tokens_per_s"], 1), "step_s": round(got["step_s"], 2),
                       "tokens_per_cpu_s": round(tokens / got["cpu_s"], 1),
                       "peak_gb": round(got["peak_bytes"] / 1e9, 3),
                       "plan_gb": round(plan / 1e9, 3), "plan_rel_err": round(plan / got["peak_bytes"] - 1, 3)}
                print(json.dumps(row), flush=True)
                runs.append(row)
    first = [r for r in runs if r["shape"] == shapes[0] and r["tokens"] == lengths[0]]
    peak = {r["option"]: r["peak_gb"] for r in first}
    grad = in_subprocess("gradients", model_dir=str(work / shapes[0]), tokens=lengths[0], vocab=vocab, threads=threads)
    return {"checkpointing_peak_ratio": round(peak["both_on"] / peak["both_off"], 3) if "both_off" in peak else None,
            "grad_rel_diff": grad,
            "plan_rel_err": max(abs(r["plan_rel_err"]) for r in runs),
            "vocab_size": vocab, "threads": threads, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shapes", default="10M,50M")
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--options", help="options run at the first shape and length (default: all; on CPU all "
                                          "but both_on_bf16)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single measurement, in its own process
    args = parser.parse_args()
    if args.one:
        job = json.loads(args.one)
        kind, model_dir = job.pop("kind"), Path(job.pop("model_dir"))
        print(json.dumps(measure_here(model_dir, **job) if kind == "measure" else gradients_here(model_dir, **job)))
        return
    import torch

    options = args.options.split(",") if args.options else [o for o in OPTIONS if torch.cuda.is_available()
                                                            or o != "both_on_bf16"]
    with tempfile.TemporaryDirectory() as work:
        result = run(args.shapes.split(","), [int(t) for t in args.tokens.split(",")], args.vocab, args.threads,
                     Path(work), options)
    write_result(args.json, result)


if __name__ == "__main__":
    main()
