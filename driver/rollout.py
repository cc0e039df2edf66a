"""The rollout of a job: prompt source, partial-rollout store and completion monitor over the engines of
an `EngineGroup`, and the driver's side of a rollout step (`step`), which also hands engines that died
and came back to the running step. With an elastic fleet (engine.min_engines) each step starts by taking
in the engines Ray has placed again, and letting those on draining nodes leave (`refresh`); a thread starts
engines whose node was lost again, in new placement groups (`watch_nodes`)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.monitor import CompletionMonitorActor
from actors.prompt_source import PromptSourceActor
from actors.store import StoreActor
from april_ray.config import Config, TrainConfig, run_seeded
from driver.engines import EngineGroup

log = logging.getLogger(__name__)


@dataclass
class RolloutGroup:
    source: object
    store: object
    monitor: object
    engines: EngineGroup
    run_id: str
    """The monitor's step tokens are (run_id, step): what `abandon` closes on the engines once it is gone."""
    ahead: dict = field(default_factory=dict)
    """Overlapped mode: the rollout step asked for before its turn, by step."""
    wait_s: float = 600.0
    """rollout.engine_wait_s: how long a step waits below engine.min_engines live engines before it fails."""
    renewing: object = field(default_factory=threading.Lock)
    """Held while engines are renewed: by the driver's thread at a step's start, or by `watcher`."""
    stop: object = field(default_factory=threading.Event)
    watcher: object = None
    """An elastic fleet: the thread that renews engines whose node was lost (`watch_nodes`) until `stop`."""

    @classmethod
    def start(cls, cfg: Config, model_path: str, train_path: str, engines: EngineGroup) -> "RolloutGroup":
        source = start_source(cfg, model_path, train_path)
        ray.get(source.num_groups_taken.remote())  # a bad dataset row stops the job here, named by file and line
        store = StoreActor.options(scheduling_strategy=on_driver_node()).remote(cfg.staleness)
        monitor = start_monitor(cfg, engines, source, store)
        if engines.missing:  # an elastic fleet's engines not placed (yet): no work for them until they are
            ray.get(monitor.leave.remote(sorted(engines.missing), counted=False))
        group = cls(source, store, monitor, engines, ray.get(monitor.run_id.remote()), wait_s=cfg.rollout.engine_wait_s)
        if engines.min_engines is not None:
            group.watcher = threading.Thread(target=group.watch_nodes, name="renew-engines", daemon=True)
            group.watcher.start()
        return group

    def step(self, step: int, version: int, keep_running: bool = False):
        """One rollout step, started and waited for: a `StepResult` of sample refs."""
        return self.result(self.begin(step, version, keep_running))

    def batch(self, step: int, version: int, train: TrainConfig):
        """The batch `step` trains at `version`. Overlapped (train.overlap): before this batch is waited for,
        the steps up to train.overlap_ahead beyond it are asked for (`asked_ahead`), each to be trained one
        version after the one before it, so they run while this batch trains and go on with the running
        groups. No further: the step after them is asked for only once this batch trains, and a step that
        ends with none asked after it stops its groups (`CompletionMonitor.step`), so the engines never
        generate for a batch more than overlap_ahead versions ahead of the learner; what spills over into
        later steps is held to staleness.max_versions per token when trained. (Four steps ahead masked
        55-72% of the trained tokens as too old, late accuracy 7.4 points below sync's, hence one by
        default: BENCHMARKS.md.)"""
        if self.engines.min_engines is not None:
            self.refresh(step)
        started = self.ahead.pop(step, None) or self.begin(step, version, overlaps(train, step))
        for later in asked_ahead(train, step):
            if later not in self.ahead:
                self.ahead[later] = self.begin(later, version + later - step, overlaps(train, later), after=later - 1)
        return self.result(started)

    def refresh(self, step: int, remind_s: float = 30.0) -> list[int]:
        """An elastic fleet at `step`'s start: engines on a node Ray reports draining leave gracefully (their
        running calls hand back every partial sample); every other engine not taking work that Ray has placed
        again is caught up to the current weights and handed to the monitor. Below engine.min_engines live, it
        waits for more, saying so every `remind_s`, up to rollout.engine_wait_s. Returns the live engines."""
        engines, start, said = self.engines, time.monotonic(), -remind_s
        live = ray.get(self.monitor.live_engines.remote())
        while True:
            gone = self.take_out(live)
            live = [e for e in live if e not in gone]
            gone = [e for e in range(len(engines.actors)) if e not in live]
            back = engines.catch_up(gone, wait_s=1.0) if gone else []
            if back:
                ray.get(self.monitor.revive.remote(back))
                live = sorted(live + back)
            engines.missing = set(gone) - set(back)
            if len(live) >= engines.min_engines:
                return live
            waited = time.monotonic() - start
            if waited > self.wait_s:
                raise RuntimeError(f"step {step}: {len(live)} engines live after {waited:.0f}s, below "
                                   f"engine.min_engines={engines.min_engines} (rollout.engine_wait_s): the cluster "
                                   f"has no room for the missing engines {sorted(engines.missing)}")
            if waited - said >= remind_s:
                said = waited
                print(f"step {step}: {len(live)} engines live, below engine.min_engines={engines.min_engines}; "
                      f"waiting up to rollout.engine_wait_s={self.wait_s:.0f}s for Ray to place engines "
                      f"{sorted(engines.missing)} again (a node with room joining)", flush=True)
            time.sleep(1.0)

    def take_out(self, live: list[int]) -> list[int]:
        """Of the `live` engines, those whose node Ray reports draining leave gracefully: the monitor gives
        them no new work, then their running calls hand back every partial sample. Those Ray no longer holds
        alive (their node lost while they were idle: no call of the monitor's failed) get no more work: a
        call would wait for them to be placed again. Then `renew`. Returns the leaving, the lost and the
        renewed."""
        leaving = [e for e in self.engines.on_draining_nodes() if e in live]
        if leaving:
            ray.get(self.monitor.leave.remote(leaving))
            self.engines.drain(leaving)
        lost = sorted(self.engines.down() & set(live) - set(leaving))
        if lost:
            ray.get(self.monitor.leave.remote(lost, False))
        renewed = self.renew()
        self.engines.missing |= {*leaving, *lost, *renewed}
        return sorted({*leaving, *lost, *renewed} & set(live))

    def renew(self) -> list[int]:
        """The engines whose node was lost with no room for them elsewhere, started again under new handles
        (`EngineGroup.renew`): the monitor gives them no work (one it thought live was idle, its death unseen)
        and takes their new handles. Returns them."""
        with self.renewing:
            renewed = self.engines.renew(self.engines.down())
            if renewed:
                ray.get(self.monitor.leave.remote(renewed, False))
                ray.get(self.monitor.renewed.remote({e: self.engines.actors[e] for e in renewed}))
        return renewed

    def watch_nodes(self, every_s: float = 2.0) -> None:
        """An elastic fleet, on a thread of its own: `renew` every `every_s` whatever the driver does. Until an
        engine that lost its node is renewed the GCS spins, retrying its placement group, and a learner step
        may take minutes (one under it here took 17 s instead of 1.5: BENCHMARKS.md). A failed try (the monitor
        dead and being restored in place, a node gone mid-call) is tried again at the next tick: the thread
        outlives it, as the job does."""
        while not self.stop.wait(every_s):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - the driver's own calls meet the same fault and handle it
                log.warning("renewing engines failed, trying again in %.0f s: %r", every_s, e)

    def begin(self, step: int, version: int, keep_running: bool = False, after: int | None = None):
        """Start a rollout step whose batch is trained at `version` (the overlapped mode starts the next one
        while the learner trains); `keep_running` leaves its unfinished groups generating after it returns;
        `after`: the step asked just before, which the monitor runs first whichever call reaches it first."""
        return self.monitor.step.remote(step, version, keep_running, after), step

    def result(self, started, poll_s: float = 1.0, drain_poll_s: float = 5.0):
        """The started step's `StepResult`. Meanwhile the driver waits on the monitor to say an engine was
        lost (one call at a time, answered when the dead engines change or the step ends); while any is, it
        tries every `poll_s` to catch it up once Ray has restarted it, and hands it back, so a step goes on (or,
        with every engine dead, resumes) without waiting for its end. An elastic fleet also looks every
        `drain_poll_s` for draining nodes and engines lost while idle (`take_out`: a notice gives seconds, a
        step may take minutes)."""
        ref, step = started
        elastic, looked, dead, changed = self.engines.min_engines is not None, time.monotonic(), [], None
        while not ray.wait([ref], timeout=0)[0]:
            if changed is None:
                changed = self.monitor.dead_engines.remote(dead, step)
            if ray.wait([changed], timeout=poll_s if dead else drain_poll_s if elastic else None)[0]:
                dead, changed = ray.get(changed), None
            if elastic and time.monotonic() - looked >= drain_poll_s:
                looked = time.monotonic()
                self.take_out([e for e in range(len(self.engines.actors)) if e not in self.engines.missing])
            back = self.engines.catch_up(dead, wait_s=poll_s) if dead else []
            if back:
                ray.get(self.monitor.revive.remote(back))
                self.engines.missing -= set(back)
        if elastic:  # what the driver's calls to engines skip until the next step
            live = ray.get(self.monitor.live_engines.remote())
            self.engines.missing = set(range(len(self.engines.actors))) - set(live)
        return ray.get(ref)

    def abandon(self, first_step: int, last_step: int, timeout_s: float = 30) -> None:
        """Stop on the engines every call this rollout's monitor sent for steps `first_step`..`last_step`
        (and those asked ahead): their step tokens closed, so none of them starts again, and every request
        aborted. The monitor is gone or being replaced: nobody would collect what they generate."""
        last = max([last_step + 1, *self.ahead])
        tokens = [(self.run_id, s) for s in range(first_step, last + 1)]
        calls = [a.abort_all.remote(t) for a in self.engines.actors for t in tokens]
        calls += [a.abort_engine.remote() for a in self.engines.actors]
        ray.wait(calls, num_returns=len(calls), timeout=timeout_s)  # a dead engine's fail: it runs nothing

    def shutdown(self) -> None:
        self.stop.set()
        if self.watcher is not None:
            self.watcher.join()  # no renew after this: the engines may be shut down next
        for actor in (self.source, self.store, self.monitor):
            ray.kill(actor)


def start_source(cfg: Config, model_path: str, train_path: str):
    """The prompt source of `cfg`'s rollout: the dataset in the run's seeded order, each prompt fitted to
    the context the responses leave."""
    return PromptSourceActor.options(scheduling_strategy=on_driver_node()).remote(
        train_path, cfg.task, str(model_path), cfg.rollout.n_samples_per_prompt, cfg.sampling.max_response_len,
        run_seeded(cfg.task.seed, cfg.train.seed), cfg.engine.max_model_len - cfg.sampling.max_response_len)


def start_monitor(cfg: Config, engines: EngineGroup, source, store):
    """The completion monitor of `cfg`'s rollout over `engines`, drawing from `source` and `store`."""
    return CompletionMonitorActor.options(scheduling_strategy=on_driver_node()).remote(
        cfg.rollout, cfg.staleness, engines.actors, engines.capacities, source, store,
        reward_per_group=cfg.task.reward_per_group)


def on_driver_node():
    """The rollout's actors take no CPU and hold the job's state: they run on the driver's node, never on a
    worker that may leave (an elastic fleet's preemptible nodes; Ray would spread them there once the
    driver's node is busy)."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def asked_ahead(train: TrainConfig, step: int) -> list[int]:
    """The steps asked for before `step`'s batch is waited for: up to train.overlap_ahead beyond it, each
    while the step before it keeps its groups running (`overlaps`), so never past the step before a
    checkpoint nor past the last; none outside the overlapped mode."""
    later = []
    for ahead in range(step + 1, step + 1 + train.overlap_ahead):
        if not overlaps(train, ahead - 1):
            break
        later.append(ahead)
    return later


def overlaps(train: TrainConfig, step: int) -> bool:
    """Whether `step`'s rollout leaves its unfinished groups running into the next one (train.overlap): not
    on the step before a checkpoint (a checkpoint holds every group taken: returned, dropped or stored),
    nor on the last."""
    return train.overlap and (step + 1) % train.save_every != 0 and step < train.num_steps - 1
