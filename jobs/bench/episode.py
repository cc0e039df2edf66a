"""Episodes with a slow tool: rollout tokens/s with a plain `def` tool vs the same tool as `async def`.

    python -m jobs.bench.episode --json PATH [--tool-s 0.5] [--samples N] [--repeats R] [key=value ...]

One engine worker (engine.backend, in this process, no Ray) runs `--samples` episodes at once: each turn
ends at any of ten letters (often, for a random policy) or at the budget, and every turn that ends at a
letter calls a tool that sleeps `--tool-s` seconds, then appends its answer. Three tools, interleaved over
`--repeats` rounds (median reported): `async` (`await asyncio.sleep`), `def` (`time.sleep`, which
`ep.call_tool` runs in a thread of its own), and `def_on_loop` (an `async def` that calls `time.sleep`:
what a plain tool cost when it ran on the engine's event loop). The figure is model tokens generated per
second of wall time over the whole batch. The policy is a randomly initialised model of `model.*` (its
speed does not depend on its weights), built in a temporary directory unless `model.path` is set.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import tempfile
import time

from jobs.common import parse, write_result
from april_ray.rollout.engine_worker import build_worker
from april_ray.rollout.episode import ToolJournal
from april_ray.types import Sample

STOPS = tuple("abcdefghij")
MODES = ("async", "def", "def_on_loop")


def tools(seconds: float) -> dict:
    async def async_tool(n):
        await asyncio.sleep(seconds)
        return n

    def def_tool(n):
        time.sleep(seconds)
        return n

    async def def_on_loop(n):
        time.sleep(seconds)
        return n

    return {"async": async_tool, "def": def_tool, "def_on_loop": def_on_loop}


def episode_with(tool):
    async def episode(ep):
        while True:
            text = await ep.generate(stop=STOPS)
            if not text.endswith(STOPS):
                return 0.0
            n = await ep.call_tool("slow", tool, ep.turn)
            ep.append_env(str(n))
    return episode


def random_model(cfg, out: str) -> str:
    from april_ray.model import build_random_model
    from april_ray.task.tokenizer import build_tokenizer

    tok = build_tokenizer()
    build_random_model(cfg.model, len(tok), tok.pad_token_id, tok.eos_token_id, seed=3).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def one_round(worker, tool, n: int, prompt_ids: list[int], budget: int, tag: str) -> dict:
    """Every sample's episode to its end: (model tokens, tool calls, seconds)."""
    worker.episode_fn = episode_with(tool)
    worker.episodes = dataclasses.replace(worker.episodes, journal=ToolJournal())
    samples = [Sample(f"{tag}s{i}", tag, "q", "", prompt_ids, budget) for i in range(n)]
    t0 = time.perf_counter()
    metas, _ = asyncio.run(worker.generate_group(samples, tag))
    wall = time.perf_counter() - t0
    stats = worker.tool_stats()
    tokens = sum(m.response_len for m in metas)
    return {"tokens": tokens, "tool_calls": stats.calls, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1)}


def main() -> None:
    def extra(p):
        p.add_argument("--json", required=True, help="where to write the figures")
        p.add_argument("--tool-s", type=float, default=0.5, help="seconds each tool call sleeps")
        p.add_argument("--samples", type=int, default=64, help="episodes run at once (engine.max_num_seqs caps)")
        p.add_argument("--repeats", type=int, default=3)

    cfg, args = parse(__doc__, extra)
    with tempfile.TemporaryDirectory() as tmp:
        path = cfg.model.path or random_model(cfg, tmp)
        worker = build_worker(cfg.engine, cfg.sampling, cfg.staleness, cfg.task, path, episodes=cfg.rollout)
        if worker.episode_fn is None:
            worker.use_episodes(None, ToolJournal(), cfg.engine.max_model_len, cfg.rollout.tool_timeout_s,
                                encode=worker.encode)
        prompt = worker.encode("12,34,56-3:")
        by_tool = tools(args.tool_s)
        runs = {m: [] for m in MODES}
        for r in range(args.repeats):
            for m in MODES:
                runs[m].append(one_round(worker, by_tool[m], args.samples, prompt, cfg.sampling.max_response_len,
                                         f"r{r}{m}"))
    med = {m: statistics.median(x["tok_s"] for x in runs[m]) for m in MODES}
    write_result(args.json, {
        "tok_s": med, "def_over_async": round(med["def"] / med["async"], 3),
        "def_on_loop_over_async": round(med["def_on_loop"] / med["async"], 3), "runs": runs,
        "setup": {"tool_s": args.tool_s, "samples": args.samples, "backend": cfg.engine.backend,
                  "max_num_seqs": cfg.engine.max_num_seqs, "max_response_len": cfg.sampling.max_response_len,
                  "num_threads": cfg.engine.num_threads, "model_path": cfg.model.path or "random"}})


if __name__ == "__main__":
    main()
