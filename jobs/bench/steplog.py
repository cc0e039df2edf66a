"""What a rollout benchmark keeps of each measured step of one mode, and the figures it reports from
them: shared by the Ray bench (`jobs/bench/rollout.py`) and the in-process one (`jobs/bench/schedule.py`).
And what the in-process one keeps of each engine step (`StepRecorder`): the features `jobs.simulate
--calibrate` fits step costs on (sim/calibrate.py), and the step's CPU time."""
from __future__ import annotations

import time

import numpy as np

from sim.calibrate import FEATURES

COUNTERS = {"engine_decoded_tokens": "num_generated_tokens", "engine_prefill_tokens": "num_prefill_tokens",
            "engine_reused_kv_tokens": "num_reused_tokens", "engine_busy_s": "busy_s", "engine_cpu_s": "cpu_s"}


class StepLog:
    """The measured steps of one mode."""

    def __init__(self, n_samples_per_prompt: int):
        self.n_samples = n_samples_per_prompt
        self.wall, self.rows, self.latencies, self.occupancy, self.lengths = 0.0, [], [], [], []
        self.seen, self.duplicated = set(), 0
        self.counters = dict.fromkeys(COUNTERS, 0)

    def add(self, dt: float, result, store_groups: int, before: list, after: list) -> None:
        """One step's result, with each engine's stats before and after it (drained after)."""
        self.wall += dt
        for key, field in COUNTERS.items():
            self.counters[key] += sum(getattr(a, field) - getattr(b, field) for a, b in zip(after, before))
        self.rows.append(result.metrics | {"store_groups": store_groups})
        self.latencies.append(result.metrics["rollout/abort_latency_s"])
        self.occupancy.append([s.occupancy for s in after])
        for meta in (m for group in result.metas for m in group):
            self.duplicated += meta.sample_id in self.seen
            self.seen.add(meta.sample_id)
            self.lengths.append(meta.response_len)

    def summary(self, num_engines: int, groups_unaccounted: int) -> dict:
        """`groups_unaccounted`: groups taken from the source minus returned, dropped and stored."""
        rows, wall, c = self.rows, self.wall, self.counters
        trained = sum(r["rollout/trained_tokens"] for r in rows)
        off = sum(r["rollout/off_policy_token_ratio"] * r["rollout/trained_tokens"] for r in rows)
        masked = sum(r["rollout/masked_token_ratio"] * r["rollout/trained_tokens"] for r in rows)
        factors = [r["rollout/over_sampling_factor"] for r in rows]
        return {
            "effective_tok_s": trained / wall,
            "generated_tok_s": sum(r["rollout/generated_tokens"] for r in rows) / wall,
            "abort_latency_ms_p99": float(np.percentile(self.latencies, 99) * 1000),
            "abort_latency_ms_p50": float(np.percentile(self.latencies, 50) * 1000),
            "off_policy_token_ratio": off / max(1, trained),
            "masked_token_ratio": masked / max(1, trained),
            "over_sampling_factor": {"mean": float(np.mean(factors)), "last": factors[-1]},
            "max_staleness": max(r["rollout/staleness_max"] for r in rows),
            "store_groups_mean": float(np.mean([r["store_groups"] for r in rows])),
            "running_rows_mean": float(np.mean([n for step in self.occupancy for eng in step for _, n in eng] or [0])),
            "boundary_ms": {part: float(np.mean([r[f"rollout/{key}"] for r in rows]) * 1000)
                            for part, key in (("start", "start_s"), ("abort", "abort_latency_s"), ("store", "store_s"))},
            # Engines inside a step over the rollout wall, and on a core while inside it.
            "engine_busy_fraction": c["engine_busy_s"] / (wall * num_engines),
            "engine_on_core": c["engine_cpu_s"] / max(1e-9, c["engine_busy_s"]),
            "prefill_per_decoded": c["engine_prefill_tokens"] / max(1, c["engine_decoded_tokens"]),
            "wall_s": wall, "steps": len(rows), "trained_tokens": trained, **c,
            "lost_samples": groups_unaccounted * self.n_samples,
            "duplicated_samples": self.duplicated,
        }



def public(res: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if not k.startswith("_")}


class StepRecorder:
    """Wraps one `LLMEngine`'s `step` (from outside, for the measurement) and keeps each step's features
    and CPU time, and the thread's CPU between steps (the front end, the workers and the monitor).

    `gaps`: per step, the thread's CPU since the last step any recorder of the run timed (-1 for the
    run's first): the other work the step follows on its core (`fit_by_gap` checks the fit against it)."""

    _last_any: float | None = None
    """Thread CPU time when the last recorded step of any engine of the run ended (all run on one
    thread; `new_run` forgets it)."""
    clock = staticmethod(time.thread_time)
    """What a step's cost is read from: the thread's CPU (the CPU engine on a shared machine); a GPU
    engine's step waits on the device, so a check on a GPU reads the wall clock instead."""

    @classmethod
    def new_run(cls) -> None:
        """A new bench run starts (its first step follows no recorded one)."""
        cls._last_any = None

    def __init__(self, engine):
        self.engine, self.inner, self.rows, self.gaps = engine, engine.step, [], []
        self.between_s, self.last = 0.0, None
        self.boundary_s, self.aborted = 0.0, 0
        self.inner_abort_tagged = engine.abort_tagged  # `abort_all` goes through it too
        engine.step, engine.abort_tagged = self.step, self.abort_tagged

    def abort_tagged(self, tag):
        outs = self.inner_abort_tagged(tag)
        self.aborted += len(outs)
        return outs

    def step(self):
        e = self.engine
        t_in = self.clock()
        if self.last is not None:
            self.between_s += t_in - self.last
        from april_ray.engine.model_runner import decode_segments

        running = len(e.scheduler.running)
        context = sum(s.num_tokens for s in e.scheduler.running)
        segments = decode_segments([s.num_tokens - 1 for s in e.scheduler.running]) if running else []
        attended = sum((end - start) * span for start, end, span in segments)
        n0, r0, g0, t0 = e.num_prefill_tokens, e.num_reused_tokens, e.num_regroups, self.clock()
        outs = self.inner()
        dt = self.clock() - t0
        prefilled, rows = e.num_prefill_tokens - n0, e.occupancy[-1][1]
        self.rows.append((1.0, rows, context, prefilled, float(prefilled > 0), rows - running,
                          e.num_reused_tokens - r0, e.num_regroups - g0, attended, dt))
        self.gaps.append(-1.0 if StepRecorder._last_any is None else t_in - StepRecorder._last_any)
        self.last = StepRecorder._last_any = self.clock()
        return outs

    def boundary(self) -> None:
        """A rollout step ends: the CPU since the engine's last step (the abort, parking the aborted caches,
        the store) is the step boundary's."""
        if self.last is not None:
            self.boundary_s += self.clock() - self.last
        self.last = None

    def between(self, process_cpu_s: float, boundary_apart: bool = True) -> dict:
        """The process's CPU outside the engine's steps (`process_cpu_s` less the steps' own): the engine
        thread's between them and every other thread's (the reward runner's, one per finished sample; on
        the bench's one core all of it holds the engine up, and the thread's own `between_s` misses it),
        less the step boundaries' if `boundary_apart`; and the steps and requests it is spread over
        (`between_costs`)."""
        outside = process_cpu_s - sum(row[-1] for row in self.rows)
        admitted = FEATURES.index("admitted")
        return {"between_s": outside - self.boundary_s if boundary_apart else outside,
                "between_thread_s": self.between_s, "steps": len(self.rows),
                "requests": sum(row[admitted] for row in self.rows)}
