"""Which engines the completion monitor gives work to.

An engine is lost when a call to it fails with `EngineFailure` (its actor died), or `left` when it leaves
gracefully (`EngineLeft`: its node is preempted or drained) or is not placed yet (an elastic fleet short of
engine.num_engines), and takes no more work until `revive` hands it back: the driver calls it once the restarted engine holds the current weights
(driver/engines.py). A death is an event the driver waits on (`changes`), not something it polls for.
"""
from __future__ import annotations

import asyncio
from typing import Callable


class EngineLiveness:
    def __init__(self, num_engines: int):
        self.alive = [True] * num_engines
        self.left = [False] * num_engines
        """Not alive because it left gracefully or is not placed yet: a leave, not a crash."""
        self.heard_s = [0.0] * num_engines
        """When each engine last returned a call: it was alive then."""
        self._revived: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        """Set when an engine is lost or revived, or a step ends: what `changes` waits on."""

    def live(self) -> list[int]:
        return [e for e, ok in enumerate(self.alive) if ok]

    def dead(self) -> list[int]:
        return [e for e, ok in enumerate(self.alive) if not ok]

    async def changes(self, known: list[int], ended: Callable[[], bool]) -> list[int]:
        """The engines now dead, as soon as that differs from `known`, or once `ended()` (checked at each
        change, and when `changed` is called)."""
        while self.dead() == list(known) and not ended():
            self._changed = self._changed or asyncio.Event()
            await self._changed.wait()
            self._changed = None
        return self.dead()

    def changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def lose(self, engine: int, left: bool = False) -> bool:
        """A call to `engine` failed with its death (or its leave, `left`); True the first time (once per
        death)."""
        if not self.alive[engine]:
            return False
        self.alive[engine], self.left[engine] = False, left
        self.changed()
        return True

    def revive(self, engines: list[int]) -> None:
        """Take engines back (restarted, and holding the current weights): they get work again at once."""
        for e in engines:
            self.alive[e], self.left[e] = True, False
        if engines and self._revived is not None:
            self._revived.set()
        self.changed()

    async def one_back(self, wait_s: float) -> bool:
        """True at once while an engine lives; with every engine dead, whether one is revived within `wait_s`."""
        self._revived = asyncio.Event()  # made on the running loop (tests run steps on several loops)
        if not any(self.alive):
            try:
                await asyncio.wait_for(self._revived.wait(), wait_s)
            except asyncio.TimeoutError:
                return False
        return True
