"""The overlapped mode, predicted: the rollout never stops on E engines while a learner trains on the
other G - E GPUs, new weights reaching the engines in flight.

What is simulated (the real `CompletionMonitor`, `PromptSource` and `EngineWorker`s on the virtual clock,
`sim.cluster.Schedule` with an `OverlapPool`): one APRIL step as long as the whole run (warm-up + measured
batches of N groups), keeping the job's N' groups in flight and topping them up as they complete, so no
engine is ever aborted but at the run's very end. Beside it, a learner on the same clock takes the next N
complete groups (in completion order) as soon as they are there, trains them for the learner time of
their tokens on its G - E GPUs (`study.learner_s_on`), spends one weight sync sending the weights, and
the engines adopt the new version at their next step boundary (`SimEngine.update_weights`): tokens
generated later carry it, a sample's tokens may span versions.

The cost model of an update in flight: the learner is busy for `study.weight_sync_s` per update (the
broadcast), and the engines pause at a token boundary for as long (their generation stops while the
weights are loaded in place, KV caches kept); the pause is charged afterwards, as tokens the engines
would have made meanwhile: the rate is scaled by (1 - weight_sync_s / update period) when the engines,
not the learner, set the pace.

The staleness bound, two ways: at training time as the job does (the batch of version j masks every
token older than `staleness.max_versions` versions, and masked tokens do not count as trained), and at
admission, a simplification of the mode's rule: no group starts or resumes while a full batch of
complete groups already waits for the learner (the engines run at most one batch ahead of it, so a
learner slower than the engines idles them instead of ageing their tokens).
"""
from __future__ import annotations

import asyncio
import dataclasses

from april_ray.rollout.local import LocalPool
from april_ray.rollout.monitor import batch_staleness, filter_reason
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


class OverlapPool(LocalPool):
    """`LocalPool` that counts the groups completed (those the dynamic filter keeps), keeps their metas in
    completion order for the learner, and holds a call back while a full batch waits untrained."""

    def __init__(self, workers, capacities: list[int], batch: int, n_samples: int, dynamic_filter: bool):
        super().__init__(workers, capacities)
        self.batch, self.n_samples, self.dynamic_filter = batch, n_samples, dynamic_filter
        self.completed: list[list] = []
        """The metas of each complete group, in completion order."""
        self.taken = 0
        """Batches the learner has taken."""
        self.open = False
        """Once the learner has taken its last batch, nothing waits at admission (the step must end)."""
        self.held_s = 0.0
        """Call-seconds spent waiting at admission."""
        self._changed: asyncio.Event | None = None

    async def changed(self) -> None:
        self._changed = self._changed or asyncio.Event()
        await self._changed.wait()

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def ahead(self) -> int:
        return len(self.completed) - self.taken * self.batch

    async def _call(self, engine, samples, step, context):
        t0 = asyncio.get_running_loop().time()
        while not self.open and self.ahead() >= self.batch:
            await self.changed()
        self.held_s += asyncio.get_running_loop().time() - t0
        return await super()._call(engine, samples, step, context)

    async def _metas(self, engine, call):
        metas = await super()._metas(engine, call)
        # a group is one call from its start to its end here (never aborted): all its samples finished
        if len(metas) == self.n_samples and all(m.state == SampleState.FINISHED for m in metas) \
                and not (self.dynamic_filter and filter_reason(metas)):
            self.completed.append(metas)
            self.notify()
        return metas


@dataclasses.dataclass
class Batch:
    taken_s: float
    done_s: float
    response_tokens: int
    train_tokens: int
    staleness: dict[int, int]


def run_overlap(setting: Setting, rollout, batch: int, n_prime: int, batches: int, warmup: int,
                learner_s_per_token: float, weight_sync_s: float, ceiling: float) -> dict:
    """The overlapped mode on `setting`'s engines: `batches` learner steps of `batch` groups, N' =
    `n_prime` groups in flight, the first `warmup` steps not measured. `learner_s_per_token`: the learner's
    seconds per train token (prompt + response) on its share of the GPUs. Figures over the measured steps."""
    block = setting.workload.block
    prompt_tokens = setting.workload.blocks(setting.workload.prompt_lens[0]) * block
    # one step of every group the run needs: the monitor tops N' back up as groups complete, never aborts
    long = dataclasses.replace(rollout, schedule="april", rollout_batch_size=batch * batches,
                               over_sampling_batch_size=n_prime)

    async def main(loop: VirtualLoop) -> dict:
        loop.clocked.add(CONTROL_PLANE)
        sched = Schedule("overlap", setting, long, loop, pool=lambda workers, capacities: OverlapPool(
            workers, capacities, batch, rollout.n_samples_per_prompt, rollout.dynamic_filter))
        p, trains = sched.pool, setting.staleness.trains
        done: list[Batch] = []

        async def learner() -> None:
            for j in range(batches):
                while len(p.completed) < (j + 1) * batch:
                    await p.changed()
                p.taken, p.open = j + 1, j + 1 == batches
                p.notify()
                t0, metas = loop.time(), p.completed[j * batch:(j + 1) * batch]
                response = sum(m.response_len for ms in metas for m in ms) * block
                train = response + prompt_tokens * sum(map(len, metas))
                await asyncio.sleep(train * learner_s_per_token + weight_sync_s)
                for w in p.workers:  # in flight: from the engines' next step boundary
                    w.update_weights(None, j + 1)
                done.append(Batch(t0, loop.time(), response, train, batch_staleness(metas, j)))

        step = loop.spawn(sched.monitor.step(0, 0), CONTROL_PLANE)
        await asyncio.gather(step, learner())
        return summary(done[warmup:], done[warmup - 1].done_s if warmup else 0.0, trains, block, setting.num_engines,
                       ceiling, weight_sync_s) | {"admission_held_call_s": p.held_s}

    return run_virtual(main)


def summary(measured: list[Batch], t0: float, trains, block: int, engines: int, ceiling: float,
            weight_sync_s: float) -> dict:
    """Trained (unmasked) response tokens per second between the end of the warm-up's last update and the
    last measured one, the engines' pause for each update charged when they set the pace."""
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
            "staleness_hist": {str(a): round(c / max(1, total), 4) for a, c in sorted(hist.items())},
            "response_tokens_per_step": total * block / len(measured),
            "train_tokens_per_step": sum(b.train_tokens for b in measured) / len(measured)}
