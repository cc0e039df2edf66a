"""EngineWorker actor: an async shell around `april_ray.rollout.engine_worker.EngineWorker`.

One actor per engine; it serves many concurrent `generate_group` calls on its event loop. A call returns
two object refs: the small `SampleMeta`s that the monitor reads, and the samples, which only their
consumer (the store, or a learner rank) ever fetches.

The driver starts it with Ray's `max_restarts` (driver/engines.py). A restarted process has loaded its
initial weights, not the current ones, so it serves nothing (`EngineFailure`: the monitor re-dispatches
elsewhere) until an `update_weights` brings it to the current policy version.
"""
from __future__ import annotations

import dataclasses

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
        with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id`
            warnings.simplefilter("ignore", DeprecationWarning)
            self.serving = not ray.get_runtime_context().was_current_actor_reconstructed
        """False after a restart, until `update_weights`: its weights are the initial ones."""

    def _check_serving(self) -> None:
        if not self.serving:
            raise EngineFailure(f"engine {self.index} was restarted (incarnation {self.incarnation}) and has "
                                f"not received the current weights yet")

    async def status(self) -> dict:
        """Which process this is, whether it serves, and its policy version (the driver's restart check)."""
        return {"incarnation": self.incarnation, "serving": self.serving, "version": self.version, "pid": os.getpid()}

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

    async def abort_all(self, step) -> int:
        return self.worker.abort_all(step)

    async def abort_engine(self) -> int:
        return self.worker.abort_engine()

    async def update_weights(self, state_dict, version: int, incarnation: str | None = None) -> dict:
        """Adopts the weights; returns `status()` (the driver counts a restart from its incarnation).
        `incarnation`: the process whose server received weights sent another way; a restarted one refuses."""
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
        and this process's incarnation (`update_weights` checks it)."""
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
