"""One simulated cluster: the real rollout (completion monitor, prompt source, partial-rollout store,
engine workers, wired in process by `april_ray.rollout.local`) against `SimEngine`s, in virtual time.

`Schedule` runs one schedule (the synchronous baseline, or APRIL at some N'/N) for some RL steps and
keeps what each step did; after every step it checks the accounting invariant (every group taken from
the source is returned, dropped or stored; no sample returned twice; every returned sample has exactly
the tokens it was drawn to end with, so none were lost across aborts and resumes). `saturated` is the
ceiling the benchmarks measure against: one engine kept full at its cap on the same length mix.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from april_ray.config import RolloutConfig, StalenessConfig
from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.local import LocalPool, LocalProxy, resolve
from april_ray.rollout.monitor import CompletionMonitor
from april_ray.rollout.prompt_source import PromptSource
from april_ray.rollout.store import PartialRolloutStore
from april_ray.types import GenerateRequest, SamplingParams, SampleState
from sim.engine import SimEngine
from sim.hardware import StepCost
from sim.workload import Workload

CONTROL_PLANE, ENGINE, OTHER = "control_plane", "engine", "other"


class InlineReward:
    """The workload's stand-in reward, called in place of the worker's `RewardRunner`: rewards are not
    simulated, and the runner's thread per finished sample (which keeps slow reward functions off an
    engine's event loop) would cost the simulation more than the sample itself."""

    errors = 0

    def __init__(self, fn):
        self.fn = fn

    async def __call__(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        return self.fn(prompt, response, answer)

    async def score(self, prompt: str, response: str, answer: str, metadata: dict | None = None):
        return self.fn(prompt, response, answer), None

    def drain_errors(self) -> int:
        return 0


@dataclass
class Setting:
    """What every engine of one simulated cluster is; lengths and capacities in the workload's blocks."""

    workload: Workload
    cost: StepCost
    num_engines: int
    max_num_seqs: int
    kv_capacity: int
    max_prefill: int
    staleness: StalenessConfig
    park_slots: int = 0
    max_versions: int = 0
    seed: int = 0

    def engine(self, version: int = 0) -> SimEngine:
        return SimEngine(self.cost, self.workload.target, self.max_num_seqs, self.kv_capacity, self.max_prefill,
                         self.workload.block, self.park_slots, self.max_versions, version)


@dataclass
class StepRecord:
    wall_s: float
    trained: int
    """Response blocks of the returned samples."""
    trained_with_prompts: int
    generated: int
    staleness: dict[int, int]
    control_plane_cpu_s: float
    process_cpu_s: float
    groups_stored: int


class Schedule:
    def __init__(self, name: str, setting: Setting, rollout: RolloutConfig, loop):
        self.name, self.setting, self.loop = name, setting, loop
        wl = setting.workload
        self.engines = [setting.engine() for _ in range(setting.num_engines)]
        if loop.default_account is not None:  # the engines' own callbacks are not the thread's shared work
            for e in self.engines:
                loop.watch(e, ENGINE)
        sampling = SamplingParams(max_new_tokens=wl.max_response_blocks)
        workers = [EngineWorker(e, wl.decode, wl.reward, sampling) for e in self.engines]
        for w in workers:
            w.reward = InlineReward(wl.reward)
        self.source = PromptSource(wl.examples(), wl.encode, rollout.n_samples_per_prompt, wl.max_response_blocks,
                                   setting.seed)
        self.store = PartialRolloutStore(setting.staleness)
        self.pool = LocalPool(workers, [setting.max_num_seqs] * setting.num_engines)
        self.monitor = CompletionMonitor(rollout, self.pool, LocalProxy(self.source), LocalProxy(self.store),
                                         setting.staleness)
        self.records: list[StepRecord] = []
        self.base = [self._counters(e) for e in self.engines]
        """Engine counters when the measured steps began (`run` resets it after the warm-up)."""
        self.seen: set[str] = set()
        self.duplicated = self.wrong_length = 0

    async def step(self, step: int, measured: bool) -> None:
        for w in self.pool.workers:  # a learner step made version `step`
            w.update_weights(None, step)
        cpu0, proc0, t0 = self.loop.cpu[CONTROL_PLANE], time.process_time(), self.loop.time()
        result = await self.loop.spawn(self.monitor.step(step, step), CONTROL_PLANE)
        # the step's wall on the virtual clock: the monitor's own measure misses the CPU of the callback it
        # is taken in (the clock moves when a callback ends), all of a step served from the store's surplus
        record = StepRecord(self.loop.time() - t0, result.metrics["rollout/trained_tokens"], 0,
                            result.metrics["rollout/generated_tokens"], result.staleness,
                            self.loop.cpu[CONTROL_PLANE] - cpu0,
                            time.process_time() - proc0, len(self.store))
        record.trained_with_prompts = self._check(result)
        for e in self.engines:  # nothing reads their per-step occupancy: drained, it does not pile up
            e.stats(drain=True)
        if measured:
            self.records.append(record)

    def _check(self, result) -> int:
        """The accounting invariant after a step; returns the batch's prompt + response blocks."""
        wl, m = self.setting.workload, self.monitor
        lost = self.source.num_groups_taken - m.num_returned_groups - m.num_dropped_groups - len(self.store)
        assert lost == 0, f"{self.name}: {lost} groups unaccounted for after step {result.step}"
        tokens = 0
        for group in result.groups:
            for sample in map(resolve, group):
                self.duplicated += sample.sample_id in self.seen
                self.seen.add(sample.sample_id)
                expected = wl.response_len(sample.prompt_ids[0], sample.sample_id)
                n = len(sample.response_ids)
                self.wrong_length += not (sample.state == SampleState.FINISHED and n == expected
                                          == len(sample.versions) == len(sample.logprobs))
                tokens += n + len(sample.prompt_ids)
        return tokens

    async def run(self, steps: int, warmup_steps: int, first_step: int = 0) -> None:
        for i in range(warmup_steps + steps):
            if i == warmup_steps:
                self.base = [self._counters(e) for e in self.engines]
            await self.step(first_step + i, measured=i >= warmup_steps)

    @staticmethod
    def _counters(e: SimEngine) -> dict[str, float]:
        return {"busy_s": e.busy_s, "row_seconds": e.row_seconds, "num_prefill": e.num_prefill,
                "num_generated": e.num_generated, "num_retracted": e.num_retracted, "num_reused": e.num_reused,
                "num_steps": e.num_steps, "row_steps": e.row_steps, "context_steps": e.context_steps,
                "attended_steps": e.attended_steps,
                "num_requests": e.num_requests, "num_spans": e.num_spans}

    def _engine_totals(self) -> dict[str, float]:
        """Engine counters summed over engines, over the measured steps."""
        return {k: sum(self._counters(e)[k] - b[k] for e, b in zip(self.engines, self.base)) for k in self.base[0]}

    def summary(self, ceiling_per_engine: float) -> dict:
        """Figures over the measured steps, in tokens (blocks x block) and virtual seconds. `effective_tok_s`
        and `utilization` count the response tokens of the returned groups, as the benchmarks do; the
        `unmasked_` ones leave out those the learner's staleness mask drops (`masked_token_ratio`)."""
        rs, block, e = self.records, self.setting.workload.block, self.setting.num_engines
        wall = sum(r.wall_s for r in rs)
        trained = sum(r.trained for r in rs)
        hist: dict[int, int] = {}
        for r in rs:
            for age, c in r.staleness.items():
                hist[age] = hist.get(age, 0) + c
        off = sum(c for age, c in hist.items() if age > 0)
        trains = self.setting.staleness.trains  # the learner drops the other tokens from the loss
        masked = sum(c for age, c in hist.items() if not trains(age))
        c = self._engine_totals()
        return {
            "effective_tok_s": trained * block / wall,
            "utilization": trained / wall / (ceiling_per_engine * e),
            "unmasked_tok_s": (trained - masked) * block / wall,
            "unmasked_utilization": (trained - masked) / wall / (ceiling_per_engine * e),
            "masked_token_ratio": masked / max(1, trained),
            "rollout_s": wall / len(rs),
            "trained_tokens_per_step": trained * block / len(rs),
            "train_tokens_per_step": sum(r.trained_with_prompts for r in rs) * block / len(rs),
            "generated_per_trained": sum(r.generated for r in rs) / max(1, trained),
            "off_policy_token_ratio": off / max(1, trained),
            "staleness_hist": {str(a): round(c / max(1, trained), 4) for a, c in sorted(hist.items())},
            "running_rows_mean": c["row_seconds"] / max(1e-12, c["busy_s"]),
            "running_rows_per_step": c["row_steps"] / max(1, c["num_steps"]),
            "engine_busy_fraction": c["busy_s"] / wall / e,
            "kv_peak_tokens": max(x.peak_context for x in self.engines) * block,
            "retractions": c["num_retracted"],
            "prefill_per_decoded": c["num_prefill"] / max(1, c["num_generated"]),
            "reused_kv_per_decoded": c["num_reused"] / max(1, c["num_generated"]),
            "attended_per_context": c["attended_steps"] / max(1, c["context_steps"] * block),
            "store_groups_mean": sum(r.groups_stored for r in rs) / len(rs),
            "control_plane_cpu_s_per_step": sum(r.control_plane_cpu_s for r in rs) / len(rs),
            "engine_side_cpu_s_per_step": sum(r.process_cpu_s - r.control_plane_cpu_s for r in rs) / len(rs),
            "sample_calls_per_step": c["num_requests"] / len(rs),
            "sample_calls_with_warmup": sum(x.num_requests for x in self.engines),
            "engine_spans_per_step": c["num_spans"] / len(rs),
            "steps": len(rs),
            "lost_groups": 0,  # `_check` asserts it after every step
            "duplicated_samples": self.duplicated,
            "samples_with_wrong_length": self.wrong_length,
        }


async def saturated(setting: Setting, loop, n_samples: int, warm: int = 4, measure: int = 16) -> float:
    """Blocks per virtual second of one engine kept full: `max_num_seqs` lanes, each replacing its finished
    request at once with the next sample of the same length mix, over `measure` x cap completions after
    `warm` x cap (so the lanes, started in lockstep, spread out first)."""
    engine = setting.engine()
    wl, cap = setting.workload, setting.max_num_seqs
    sampling = SamplingParams(max_new_tokens=wl.max_response_blocks)
    counter, done, marks = itertools.count(), itertools.count(1), {}

    async def lane() -> None:
        while len(marks) < 2:
            i = next(counter)
            row = (i // n_samples) % len(wl.prompt_lens)
            rid = f"probe-e0p{row}s{i % n_samples}@probe"
            await engine.generate(GenerateRequest(rid, wl.encode(str(row)), sampling))
            k = next(done)
            if k in (warm * cap, (warm + measure) * cap):
                marks[k] = (engine.num_generated, loop.time())

    lanes = [asyncio.ensure_future(lane()) for _ in range(cap)]
    while len(marks) < 2:
        await asyncio.wait(lanes, return_when=asyncio.FIRST_COMPLETED, timeout=3600.0)
    engine.abort_all()
    await asyncio.gather(*lanes)
    (n0, t0), (n1, t1) = (marks[k] for k in sorted(marks))
    return (n1 - n0) / (t1 - t0)


async def restarted_probe(setting: Setting, loop, rows: list[int], n_samples: int, warmup_s: float,
                          window_s: float) -> tuple[float, float]:
    """`engine.probe.saturated_throughput` as the benchmarks run it, on one simulated engine: `max_num_seqs`
    lanes started together, each replacing its finished request at once with the next prompt of `rows`
    (the i-th request: prompt i mod len(rows), that prompt's sample (i div len(rows)) mod n_samples), the
    blocks decoded in `window_s` after `warmup_s` counted. Returns (blocks per virtual second, mean
    context per running row in the window, in blocks). Unlike `saturated`, its lanes start in lockstep
    and are measured before their ages spread to the steady state: short contexts, a faster engine."""
    engine = setting.engine()
    wl = setting.workload
    sampling = SamplingParams(max_new_tokens=wl.max_response_blocks)
    counter, stop = itertools.count(), False

    async def lane() -> None:
        while not stop:
            i = next(counter)
            row = rows[i % len(rows)]
            rid = f"probe-e0p{row}s{(i // len(rows)) % n_samples}@probe"
            await engine.generate(GenerateRequest(rid, wl.encode(str(row)), sampling))

    lanes = [asyncio.ensure_future(lane()) for _ in range(setting.max_num_seqs)]
    await asyncio.sleep(warmup_s)
    n0, rs0, cs0, t0 = engine.num_generated, engine.row_steps, engine.context_steps, loop.time()
    await asyncio.sleep(window_s)
    n1, rs1, cs1, t1 = engine.num_generated, engine.row_steps, engine.context_steps, loop.time()
    stop = True
    engine.abort_all()
    await asyncio.gather(*lanes)
    return (n1 - n0) / (t1 - t0), (cs1 - cs0) / max(1, rs1 - rs0)
