"""EngineWorker actor: an async shell around `april_ray.rollout.engine_worker.EngineWorker`.

One actor per engine; it serves many concurrent `generate_group` calls on its event loop. A call returns
two object refs: the small `SampleMeta`s that the monitor reads, and the samples, which only their
consumer (the store, or a learner rank) ever fetches.

The driver starts it with Ray's `max_restarts` (driver/engines.py). A restarted process has loaded its
initial weights, not the current ones, so it serves nothing (`EngineFailure`: the monitor re-dispatches
elsewhere) until an `update_weights` brings it to the current policy version.

A preemption notice (SIGTERM to the process, or `drain` from the driver when Ray reports its node draining)
makes it leave gracefully (`EngineWorker.leave`): its running calls return every partial sample with the
tokens generated so far, and every later call is refused with `EngineLeft`, which the monitor counts as a
leave, not a crash. It stays refusing until its process ends with its node; Ray then restarts it wherever
its placement group is placed again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
import warnings

import ray

from actors.metrics import EngineMetrics
from actors.refs import fetch_async
from actors.journal import RayJournal
from april_ray.config import EngineConfig, RolloutConfig, SamplingConfig, StalenessConfig, TaskConfig
from april_ray.rollout.engine_worker import build_worker
from april_ray.engine.base import EngineFailure

log = logging.getLogger(__name__)


@ray.remote
class EngineWorkerActor:
    def __init__(self, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, staleness: StalenessConfig,
                 task: TaskConfig, model_path: str, version: int = 0, index: int = 0,
                 episodes: RolloutConfig | None = None, journal=None, weights_root: str = ""):
        """`journal`: the job's `ToolJournalActor`, when `episodes.episode_fn` runs episodes. `weights_root`:
        where its server may load weights from disk (engine.weight_sync=disk)."""
        # a sampling stream of its own: with one seed, every engine drew the same random numbers
        engine_cfg = dataclasses.replace(engine_cfg, seed=engine_cfg.seed + index)
        self.worker = build_worker(engine_cfg, sampling_cfg, staleness, task, model_path, version, episodes=episodes,
                                   journal=RayJournal(journal) if journal is not None else None,
                                   weights_root=weights_root)
        self.metrics = EngineMetrics(index, engine_cfg.max_num_seqs)
        self.metrics.set_version(version)
        self.index, self.version = index, version
        self.incarnation = uuid.uuid4().hex[:8]
        self.loop: asyncio.AbstractEventLoop | None = None
        """The actor's event loop, once a call ran on it: where a SIGTERM's drain is scheduled."""
        on_sigterm(self._preempted)
        with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id`
            warnings.simplefilter("ignore", DeprecationWarning)
            self.serving = not ray.get_runtime_context().was_current_actor_reconstructed
        """False after a restart, until `update_weights`: its weights are the initial ones."""

    def _check_serving(self) -> None:
        self.worker.check_staying()
        if not self.serving:
            raise EngineFailure(f"engine {self.index} was restarted (incarnation {self.incarnation}) and has "
                                f"not received the current weights yet")

    async def status(self) -> dict:
        """Which process this is, whether it serves, and its policy version (the driver's restart check); a
        leaving engine raises `EngineLeft`, so the driver never takes it back."""
        self.loop = asyncio.get_running_loop()
        self.worker.check_staying()
        return {"incarnation": self.incarnation, "serving": self.serving, "version": self.version, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    async def generate_group(self, step, samples: list, context: list = ()):
        """Call with `.options(num_returns=2)`: the metas (for the monitor), then the list of samples
        (for their consumer; see actors/refs.py).

        Samples are values, object refs, or `SampleRef`s to an earlier call's result (a sample interrupted
        by someone else's abort is re-sent by its handle), in one list argument: Ray serializes each
        top-level argument on its own, and one list cost the monitor ~0.4 ms a call to submit against
        ~0.6 ms for a group's eight samples as separate arguments. `context`: the group's finished samples,
        the same way (task.reward_per_group only), fetched with them."""
        self._check_serving()
        self.metrics.call_started(self.worker.stats)
        try:
            values = await fetch_async([*samples, *context])
            return await self.worker.generate_group(values[:len(samples)], step, values[len(samples):])
        finally:
            self.metrics.call_ended()

    async def throughput_probe(self, prompts: list[list[int]], concurrency: int, seconds: float):
        self._check_serving()
        return await self.worker.throughput_probe(prompts, concurrency, seconds)

    async def evaluate(self, items, temperature: float, tag: str,
                       top_p: float | None = None) -> list[tuple[float, int]]:
        self._check_serving()
        return await self.worker.evaluate(items, temperature, tag, top_p)

    async def drain(self) -> int:
        """Leave gracefully (the driver saw the node draining): returns once every running call returned its
        partial samples; the requests aborted."""
        return await self.worker.leave()

    def _preempted(self) -> None:
        """SIGTERM, in the main thread: the drain runs on the actor's event loop."""
        log.warning("engine %d got SIGTERM: leaving gracefully, its partial samples handed back", self.index)
        if self.loop is None:  # no call ever ran here: nothing to hand back
            self.worker.leaving = True
        else:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self.worker.leave()))

    async def abort_all(self, step) -> int:
        return self.worker.abort_all(step)

    async def abort_engine(self) -> int:
        return self.worker.abort_engine()

    async def update_weights(self, state_dict, version: int, incarnation: str | None = None) -> dict:
        """Adopts the weights; returns `status()` (the driver counts a restart from its incarnation).
        `incarnation`: the process whose server received weights sent another way; a restarted one refuses."""
        self.worker.check_staying()
        if incarnation is not None and incarnation != self.incarnation:
            raise EngineFailure(f"engine {self.index} was restarted (now {self.incarnation}) after its server "
                                f"in {incarnation} received the weights of version {version}")
        self.worker.update_weights(state_dict, version)
        self.metrics.set_version(version)
        self.version, self.serving = version, True
        return await self.status()

    async def server_url(self) -> str:
        """A server backend (engine.backend cpu_http, sglang): where this engine's server answers (the learner sends weights there)."""
        return self.worker.engine.url

    async def server_access(self) -> tuple[str, str, str]:
        """A server backend: (URL, admin key) of this engine's server, for a learner to send it weights,
        and this process's incarnation (`update_weights` checks it). A leaving engine is left out."""
        self.worker.check_staying()
        return self.worker.engine.url, self.worker.engine.admin_api_key, self.incarnation

    async def release_memory(self, tags: list[str]) -> None:
        await self.worker.engine.release_memory_occupation(tags)

    async def resume_memory(self, tags: list[str]) -> None:
        await self.worker.engine.resume_memory_occupation(tags)

    async def set_kv_reuse(self, enabled: bool) -> None:
        """Benchmark switch of the CPU engine (jobs/bench/rollout.py's `april_recompute` mode)."""
        self.worker.engine.set_kv_reuse(enabled)

    async def where(self) -> tuple[str, list[str]]:
        """(node id, accelerator ids Ray assigned to this actor)."""
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]

    async def stats(self, drain: bool = True):
        """The engine's statistics; draining them (once per step, by the driver) records its metrics."""
        stats = self.worker.stats(drain)
        if drain:
            self.metrics.record(stats)
        return stats


def on_sigterm(callback) -> None:
    """Call `callback` (in the main thread) on SIGTERM instead of exiting. An async actor's constructor runs
    off the main thread, where `signal.signal` is refused, so the hook is the function Ray's own SIGTERM
    handler calls (`Worker.main_loop`: it raises SystemExit through it). Without that hook (another Ray)
    SIGTERM exits as before, after the running calls end, and `drain` is the graceful way."""
    from ray._private import worker as ray_worker

    if not callable(getattr(ray_worker, "raise_sys_exit_with_custom_error_message", None)):
        log.warning("SIGTERM cannot be hooked in this Ray version: an engine preempted by SIGTERM exits "
                    "once its calls end; the driver's drain (Ray's drain-node) still parks its samples")
        return
    ray_worker.raise_sys_exit_with_custom_error_message = lambda *args, **kwargs: callback()
