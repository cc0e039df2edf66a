"""The order the completion monitor runs steps in: one at a time, the lowest asked first.

The overlapped mode (train.overlap) asks for the next train.overlap_ahead steps before this one's batch is
back, and an async actor may start the calls in any order: a step names the one it was asked `after`, which
runs first.
After a step that left groups running on the engines, only the step right after it may run (it goes on
with them).
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Callable


class StepOrder:
    def __init__(self):
        self._turns: tuple[asyncio.AbstractEventLoop, asyncio.Condition] | None = None
        self.asked: set[int] = set()
        """Steps asked for and not yet returned."""
        self._stepping = False
        self.last_step = -1
        """The last step that ended (finished or failed)."""

    def asked_after(self, step: int) -> bool:
        """A later step has been asked for (the groups of `step` may keep running into it)."""
        return any(later > step for later in self.asked)

    @asynccontextmanager
    async def turn(self, step: int, after: int | None, left_running: Callable[[], bool], on_end: Callable[[], None]):
        """Wait until `step` may run, and hold the turn while it runs. `left_running()`: the last step left
        groups running. `on_end` is called once `last_step` counts this step, before the next may start."""
        if self._turns is None or self._turns[0] is not asyncio.get_running_loop():  # tests use several loops
            self._turns = (asyncio.get_running_loop(), asyncio.Condition())
        turns = self._turns[1]
        async with turns:
            self.asked.add(step)
            await turns.wait_for(lambda: not self._stepping and step == min(self.asked)
                                 and (after is None or self.last_step >= after)
                                 and (not left_running() or step == self.last_step + 1))
            self._stepping = True
        try:
            yield
        finally:
            self.last_step = max(self.last_step, step)
            on_end()
            async with turns:
                self.asked.discard(step)
                self._stepping = False
                turns.notify_all()
