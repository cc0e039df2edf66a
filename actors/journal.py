"""ToolJournal actor: the job's record of episode tool results (april_ray/rollout/episode.py), one per job.

Ray restarts it (`max_restarts`); a restarted one reads its file back, so a result recorded once is never
lost while the job's output directory lives, and the calls its death cut off are sent again
(`max_task_retries`: `begin` only reads, and `put` of a key already in the file does nothing). It runs on the driver's node and watches the driver's process:
once the driver is gone (killed, say), it refuses every new tool call (`ToolCallsStopped` in the episode),
so engines that outlive their driver by the moment Ray takes to notice start no tool; a call already
running finishes, and its result is still journaled while this process lives.
"""
from __future__ import annotations

import psutil
import ray

from april_ray.rollout.episode import ToolJournal


class ProcessWatch:
    """Whether a process still runs: by pid and start time (a reused pid is another process), a zombie being
    gone. None: no process to watch, always running."""

    def __init__(self, pid: int | None):
        self.pid = pid
        try:
            self.process = psutil.Process(pid) if pid is not None else None
        except psutil.NoSuchProcess:
            self.process = False  # gone already (this actor restarted after the driver died)

    def __call__(self) -> bool:
        if self.process is None:
            return True
        try:
            return bool(self.process) and self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class ToolJournalActor:
    def __init__(self, path: str, driver_pid: int | None = None):
        """`driver_pid`: the job's driver, on this node: no new call starts once it is gone."""
        self.journal = ToolJournal(path, calls_open=ProcessWatch(driver_pid))

    async def begin(self, key: str):
        return await self.journal.begin(key)

    async def put(self, key: str, value) -> None:
        await self.journal.put(key, value)


class RayJournal:
    """The journal as an episode sees it: awaitable `begin` and `put` on the actor."""

    def __init__(self, actor):
        self.actor = actor

    async def begin(self, key: str):
        return await self.actor.begin.remote(key)

    async def put(self, key: str, value) -> None:
        await self.actor.put.remote(key, value)
