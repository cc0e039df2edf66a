"""Fakes for testing the rollout without Ray: an engine with token-granular continuous batching whose
response length is encoded in the prompt (its first id), and the rollout wired on it in process
(`april_ray.rollout.local`)."""
from __future__ import annotations

import asyncio
import random

from april_ray.task.data import Example
from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.prompt_source import PromptSource
from april_ray.rollout.local import LocalPool, LocalProxy
from april_ray.rollout.store import PartialRolloutStore
from april_ray.types import FinishReason, GenerateOutput, SamplingParams

TOKEN = 7


class FakeEngine:
    """Every running request gets one token per tick; it stops when its response reaches input_ids[0]."""

    def __init__(self, tick: float = 0.0002, seed: int = 0, cap: int = 1 << 30):
        self.tick = tick
        self.cap = cap
        self.rng = random.Random(seed)
        self.version = 0
        self.running: dict[str, list] = {}
        self.max_running = 0
        self.num_calls = 0
        self.request_ids: list[str] = []
        self.ticks = 0
        self._task = None

    async def generate(self, req):
        fut = asyncio.get_running_loop().create_future()
        self.running[req.request_id] = [req, [], fut]
        self.num_calls += 1
        self.request_ids.append(req.request_id)
        self.max_running = max(self.max_running, min(self.cap, len(self.running)))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        return await fut

    async def _loop(self):
        while self.running:
            await asyncio.sleep(self.tick * self.rng.uniform(0.5, 1.5))
            self.ticks += 1
            for rid, (req, toks, fut) in list(self.running.items())[: self.cap]:  # the rest wait
                toks.append(TOKEN)
                total = len(req.input_ids) - 1 + len(toks)
                if total >= req.input_ids[0]:
                    self._finish(rid, FinishReason.STOP)
                elif len(toks) >= req.sampling.max_new_tokens:
                    self._finish(rid, FinishReason.LENGTH)

    def _finish(self, rid, reason):
        req, toks, fut = self.running.pop(rid)
        if not fut.done():
            fut.set_result(GenerateOutput(rid, list(toks), [-0.5] * len(toks), [self.version] * len(toks), reason))

    def abort(self, rid, park=True):
        if rid in self.running:
            self._finish(rid, FinishReason.ABORT)
            return True
        return False

    def abort_tagged(self, tag):
        ids = [rid for rid in self.running if rid.endswith(tag)]
        for rid in ids:
            self._finish(rid, FinishReason.ABORT)
        return len(ids)

    def abort_all(self):
        return self.abort_tagged("")

    def update_weights(self, state_dict, version):
        self.version = version

    def stats(self, drain=True):
        return None


def length_examples(num: int, seed: int, median: int = 20, tail: int = 400) -> list[Example]:
    """Prompts whose only token is the target response length (log-uniform-ish long tail)."""
    rng = random.Random(seed)
    lengths = [min(tail, int(median * 2 ** rng.expovariate(0.7))) for _ in range(num)]
    return [Example(i, str(L), str(L % 3 == 0)) for i, L in enumerate(lengths)]


def parity_reward(prompt, text, answer):
    return float(answer == "True")


class TickPool(LocalPool):
    """A pool whose aborts are `abort_ticks` engine ticks on their way, counted on the engines rather than
    the clock (a loaded machine can run a wall-clock delay out in a tick or two)."""

    def __init__(self, workers, capacities, engines, abort_ticks: int):
        super().__init__(workers, capacities)
        self.engines, self.abort_ticks = engines, abort_ticks

    async def abort_all(self, step, engines):
        start = [e.ticks for e in self.engines]
        while any(e.running and e.ticks - t < self.abort_ticks for e, t in zip(self.engines, start)):
            await asyncio.sleep(self.engines[0].tick)
        await super().abort_all(step, engines)


def make_rollout_parts(cfg, num_examples=500, seed=0, num_engines=2, cap=16, tick=0.0002, abort_delay=0.0,
                       reward_fn=parity_reward, reward_per_group=False, abort_ticks=0):
    from april_ray.rollout.monitor import CompletionMonitor

    engines = [FakeEngine(tick, seed + e, cap) for e in range(num_engines)]
    sp = SamplingParams(temperature=1.0)
    workers = [EngineWorker(e, lambda ids: "x" * len(ids), reward_fn, sp, reward_per_group=reward_per_group)
               for e in engines]
    if abort_ticks:
        pool = TickPool(workers, [cap] * num_engines, engines, abort_ticks)
    else:
        pool = LocalPool(workers, [cap] * num_engines, abort_delay)
    source = PromptSource(length_examples(num_examples, seed), lambda text: [int(text)],
                          cfg.rollout.n_samples_per_prompt, cfg.sampling.max_response_len, seed)
    store = PartialRolloutStore(cfg.staleness)
    rollout = CompletionMonitor(cfg.rollout, pool, LocalProxy(source), LocalProxy(store), cfg.staleness)
    return rollout, pool, source, store, engines
