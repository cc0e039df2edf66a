"""The overlapped mode (train.overlap), predicted: the rollout never stops on E engines while a learner
trains on the other G - E GPUs, new weights reaching the engines in flight.

What is simulated is the job's own loop on the virtual clock: the real `CompletionMonitor`, `PromptSource`,
store and `EngineWorker`s (`sim.cluster.Schedule`) driven as `driver/train.py` drives them in this mode.
Each step's batch comes from `CompletionMonitor.step(step, version, keep_running=True)`: it returns at its
N-th complete group without an interrupt, and its other groups go on generating into the next step. The
steps are asked for as `RolloutGroup.batch` (driver/rollout.py) asks: before waiting for step k's batch,
steps k + 1 .. k + `ahead` (train.overlap_ahead), step k + j to be trained at version V_k + j; the monitor
runs the steps one at a time, back to back, so the engines run at most `ahead` batches ahead of the
learner. When they are that far ahead, step k + `ahead` keeps no group running (none is asked after it):
it interrupts and stores them, as the monitor does in the job, and the engines wait until the learner
takes the next batch (that look-ahead is the admission rule modelled; no other one). As in the job, the
last step drains; no checkpoint is simulated.

The learner, beside the monitor on the same clock, trains step k's batch at version k for the learner time
of its tokens (prompt + response) on its G - E GPUs (`study.learner_s_on`), spends one weight sync
sending the weights (`study.weight_sync_s`), and publishes version k + 1: the engines adopt it at their
next step boundary (`SimEngine.update_weights`), tokens generated later carry it, a sample's tokens may
span versions. The pause of an update in flight: the engines stop at a token boundary for as long as
the weight sync while the weights are loaded in place (KV caches kept), charged afterwards as tokens they
would have made meanwhile: the rate is scaled by (1 - weight_sync_s / update period) when the engines,
not the learner, set the pace. Tokens older than `staleness.max_versions` versions than their batch's
are masked at training, as the job's learner does, and do not count as trained.
"""
from __future__ import annotations

import asyncio
import dataclasses

from april_ray.rollout.local import resolve
from april_ray.types import SampleState
from sim.clock import VirtualLoop, run_virtual
from sim.cluster import CONTROL_PLANE, Schedule, Setting

LEARNER_SHARES = (1 / 2, 3 / 8, 1 / 4, 3 / 16, 1 / 8, 1 / 16)
"""The splits evaluated at G GPUs: the learner gets G x share of them (whole engines' worth, at least one
GPU each side), the engines the rest."""


def splits(gpus: int, gpus_per_engine: int = 1) -> list[dict]:
    """{engines, learner} GPU splits of `gpus`, one per `LEARNER_SHARES` that leaves a whole number of
    engines and at least one GPU to each side, without repeats."""
    out = []
    for share in LEARNER_SHARES:
        learner = round(gpus * share / gpus_per_engine) * gpus_per_engine
        split = {"engines": gpus - learner, "learner": learner}
        if learner >= 1 and gpus - learner >= gpus_per_engine and split not in out:
            out.append(split)
    return out


def asked_ahead(step: int, last: int, ahead: int = 1) -> list[int]:
    """The steps `RolloutGroup.batch` asks for before it waits for `step`'s batch (driver/rollout.py): the
    next `ahead` ones, while the step before each keeps its groups running (`overlaps`: every step but the
    last, no checkpoint here)."""
    return list(range(step + 1, min(step + ahead, last) + 1))


@dataclasses.dataclass
class Batch:
    taken_s: float
    done_s: float
    response_tokens: int
    train_tokens: int
    staleness: dict[int, int]
    waiting: int
    """1 when the batch was complete before the learner came for it (the rollout ran ahead of the learner),
    0 when the learner waited for the engines."""


class Checks:
    """What the run must keep, as `Schedule._check` keeps it for the synchronous schedules: no sample
    trained twice, each with exactly the tokens it was drawn to end with; counted, not asserted."""

    def __init__(self, workload):
        self.workload, self.seen = workload, set()
        self.duplicated = self.wrong_length = 0

    def batch(self, result) -> int:
        """Counts the batch's samples; returns its prompt + response blocks."""
        tokens = 0
        for group in result.groups:
            for sample in map(resolve, group):
                self.duplicated += sample.sample_id in self.seen
                self.seen.add(sample.sample_id)
                n = len(sample.response_ids)
                self.wrong_length += not (sample.state == SampleState.FINISHED and n == len(sample.versions)
                                          == self.workload.response_len(sample.prompt_ids[0], sample.sample_id))
                tokens += n + len(sample.prompt_ids)
        return tokens


def run_overlap(setting: Setting, rollout, batch: int, n_prime: int, batches: int, warmup: int,
                learner_s_per_token: float, weight_sync_s: float, ceiling: float, ahead: int = 1) -> dict:
    """The overlapped mode on `setting`'s engines: `batches` learner steps of `batch` groups, N' =
    `n_prime` groups in flight while a step collects, the first `warmup` steps not measured.
    `learner_s_per_token`: the learner's seconds per train token (prompt + response) on its share of the
    GPUs; `ahead`: the batches the engines may run ahead of the learner (train.overlap_ahead). Figures over
    the measured steps."""
    block = setting.workload.block
    rollout = dataclasses.replace(rollout, schedule="april", rollout_batch_size=batch, over_sampling_batch_size=n_prime)

    async def main(loop: VirtualLoop) -> dict:
        loop.clocked.add(CONTROL_PLANE)
        sched = Schedule("overlap", setting, rollout, loop)
        monitor, checks, aborts = sched.monitor, Checks(setting.workload), []
        abort_all = sched.pool.abort_all

        async def counted_abort(token, engines):
            aborts.append(token)
            await abort_all(token, engines)

        sched.pool.abort_all = counted_abort
        done: list[Batch] = []
        asked: dict[int, asyncio.Task] = {}

        def busy_s() -> float:
            return sum(e.busy_s for e in sched.engines)

        base = busy_s()

        def ask(step: int, version: int) -> asyncio.Task:
            return loop.spawn(monitor.step(step, version, step < batches - 1), CONTROL_PLANE)

        version = 0
        for k in range(batches):  # driver/train.py's loop: the batch, the learner's step, the weights out
            started = asked.pop(k, None) or ask(k, version)
            for j in asked_ahead(k, batches - 1, ahead):
                if j not in asked:
                    asked[j] = ask(j, version + j - k)
            ready = started.done()  # the rollout was ahead: the learner did not wait for this batch
            result = await started
            t0 = loop.time()
            train = checks.batch(result) * block
            await asyncio.sleep(train * learner_s_per_token + weight_sync_s)
            version += 1
            for w in sched.pool.workers:  # in flight: from the engines' next step boundary
                w.update_weights(None, version)
            done.append(Batch(t0, loop.time(), result.metrics["rollout/trained_tokens"] * block, train,
                              result.staleness, int(ready)))
            if k == warmup - 1:
                base = busy_s()
        busy = busy_s() - base
        lost = sched.source.num_groups_taken - monitor.num_returned_groups - monitor.num_dropped_groups - len(sched.store)
        out = summary(done[warmup:], done[warmup - 1].done_s if warmup else 0.0, setting.staleness.trains, block,
                      setting.num_engines, ceiling, weight_sync_s)
        return out | {"engine_busy_fraction": busy / (out["period_s"] * len(done[warmup:])) / setting.num_engines,
                      "aborts": len(aborts), "lost_groups": lost, "duplicated_samples": checks.duplicated,
                      "samples_with_wrong_length": checks.wrong_length,
                      "batches_waiting_mean": sum(b.waiting for b in done[warmup:]) / len(done[warmup:])}

    return run_virtual(main)


def summary(measured: list[Batch], t0: float, trains, block: int, engines: int, ceiling: float,
            weight_sync_s: float) -> dict:
    """Trained (unmasked) response tokens per second between the end of the warm-up's last update and the
    last measured one, the engines' pause for each update charged when they set the pace; the trained
    tokens' ages (versions between the one that sampled a token and the one its batch trains at)."""
    wall = measured[-1].done_s - t0
    hist: dict[int, int] = {}
    for b in measured:
        for age, c in b.staleness.items():
            hist[age] = hist.get(age, 0) + c
    total = sum(hist.values())
    masked = sum(c for age, c in hist.items() if not trains(age))
    period = wall / len(measured)
    learner_busy = sum(b.done_s - b.taken_s for b in measured) / wall
    # the learner waited for its batches (< 1 busy): the engines set the pace, and each update paused them
    pause = 1 - weight_sync_s / period if learner_busy < 0.999 else 1.0
    tok_s = (total - masked) * block / wall * pause
    return {"tok_s": tok_s, "utilization": tok_s / (ceiling * block * engines), "period_s": period,
            "learner_busy_fraction": learner_busy, "pause_factor": pause,
            "masked_token_ratio": masked / max(1, total),
            "off_policy_token_ratio": sum(c for age, c in hist.items() if age > 0) / max(1, total),
            "staleness_mean": sum(a * c for a, c in hist.items()) / max(1, total),
            "staleness_max": max((a for a, c in hist.items() if c), default=0),
            "staleness_hist": {str(a): round(c / max(1, total), 4) for a, c in sorted(hist.items())},
            "response_tokens_per_step": total * block / len(measured),
            "train_tokens_per_step": sum(b.train_tokens for b in measured) / len(measured)}
