"""What a rollout benchmark keeps of each measured step of one mode, and the figures it reports from
them: shared by the Ray bench (`jobs/bench/rollout.py`) and the in-process one (`jobs/bench/schedule.py`)."""
from __future__ import annotations

import numpy as np

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
