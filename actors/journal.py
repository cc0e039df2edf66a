"""ToolJournal actor: the job's record of episode tool results (april_ray/rollout/episode.py), one per job.

Ray restarts it (`max_restarts`); a restarted one reads its file back, so a result recorded once is never
lost while the job's output directory lives.
"""
from __future__ import annotations

import ray

from april_ray.rollout.episode import ToolJournal


@ray.remote(num_cpus=0, max_restarts=-1)
class ToolJournalActor:
    def __init__(self, path: str):
        self.journal = ToolJournal(path)

    async def get(self, key: str):
        return await self.journal.get(key)

    async def put(self, key: str, value) -> None:
        await self.journal.put(key, value)


class RayJournal:
    """The journal as an episode sees it: awaitable `get` and `put` on the actor."""

    def __init__(self, actor):
        self.actor = actor

    async def get(self, key: str):
        return await self.actor.get.remote(key)

    async def put(self, key: str, value) -> None:
        await self.actor.put.remote(key, value)
