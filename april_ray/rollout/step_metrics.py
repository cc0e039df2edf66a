"""A rollout step's figures (the `rollout/*` metrics of its `StepResult`), from its `StepState` and the metas
of the groups it returns: what the tracking logs and, through occupancy and the masked share, what the
auto N' observes (april_ray/rollout/over_sampling.py)."""
from __future__ import annotations

from typing import Callable

from april_ray.rollout.step_state import StepState
from april_ray.types import SampleMeta


def batch_staleness(metas: list[list[SampleMeta]], version: int) -> dict[int, int]:
    """Response tokens of the batch by age in policy versions."""
    hist: dict[int, int] = {}
    for ms in metas:
        for m in ms:
            for v, c in m.version_counts.items():
                hist[version - v] = hist.get(version - v, 0) + c
    return dict(sorted(hist.items()))


def step_metrics(s: StepState, metas, staleness: dict[int, int], wall: float, store_s: float) -> dict[str, float]:
    trained = sum(m.response_len for ms in metas for m in ms)
    num_samples = max(1, sum(map(len, metas)))
    off_policy = sum(c for age, c in staleness.items() if age > 0)
    return {
        "rollout/wall_s": wall,
        "rollout/abort_latency_s": s.abort_latency_s,
        "rollout/abort_resends": s.abort_resends,
        "rollout/start_s": s.start_s,
        "rollout/store_s": store_s,
        "rollout/generated_tokens": s.generated_tokens,
        "rollout/trained_tokens": trained,
        "rollout/effective_tok_s": trained / wall if wall > 0 else 0.0,
        "rollout/generated_tok_s": s.generated_tokens / wall if wall > 0 else 0.0,
        "rollout/off_policy_token_ratio": off_policy / max(1, trained),
        "rollout/staleness_max": max((a for a, c in staleness.items() if c), default=0),
        "rollout/versions_in_batch": sum(1 for c in staleness.values() if c),
        "rollout/staleness_mean": sum(a * c for a, c in staleness.items()) / max(1, trained),
        "rollout/groups_fresh": s.num_fresh,
        "rollout/groups_resumed": s.num_resumed,
        "rollout/episodes_resumed": s.num_episodes_resumed,
        "rollout/env_tokens": sum(m.num_env_tokens for ms in metas for m in ms),
        "rollout/groups_filtered": sum(r != "episode_error" for r in s.dropped.values()),
        "rollout/episode_errors": len(s.episode_errors),
        "rollout/groups_episode_error": sum(r == "episode_error" for r in s.dropped.values()),
        "rollout/engine_crashes": s.engine_crashes,
        "rollout/engine_leaves": s.engine_leaves,
        "rollout/crash_tokens_lost": round(s.crash_tokens_lost),
        "rollout/reward_mean": sum(m.reward for ms in metas for m in ms) / num_samples,
        "rollout/response_len_mean": trained / num_samples,
    }


def over_sampling_metrics(s: StepState, staleness: dict[int, int], wall: float, slots: int, factor: float,
                          trains: Callable[[int], bool]) -> dict[str, float]:
    """The step's N'/N (`factor`) and what the auto N' observes: the samples held in engine calls (running,
    queued at an engine, or finished and waiting for the call's other samples) averaged over the step, per
    slot of the live engines (`slots`); and the share of the batch's tokens the learner masks as stale (those
    it does not `trains`)."""
    masked = sum(c for age, c in staleness.items() if not trains(age))
    return {"rollout/over_sampling_factor": factor,
            "rollout/occupancy": s.sample_seconds / wall / slots if wall > 0 and slots else 0.0,
            "rollout/masked_token_ratio": masked / max(1, sum(staleness.values()))}
