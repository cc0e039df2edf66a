"""asyncio front end of an `LLMEngine`, so one Ray async actor serves many concurrent `generate` calls.

The engine loop runs as a task on the actor's event loop and yields between steps; `generate`, `abort`
and `update_weights` therefore always run between two steps, never inside one, and need no locks. A
bad request fails its own call only; the loop keeps serving the others.
"""
from __future__ import annotations

import asyncio

from april_ray.engine.cpu_engine import LLMEngine
from april_ray.types import EngineStats, GenerateOutput, GenerateRequest


YIELDS_PER_STEP = 4


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._futures: dict[str, asyncio.Future] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._held = asyncio.Event()
        self._held.set()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.engine.add_request(request)
        fut = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = fut
        self._start()
        try:
            return await fut
        except asyncio.CancelledError:  # the caller gave up (e.g. ray.cancel): free the slot
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str, park: bool = True) -> bool:
        out = self.engine.abort(request_id, park)
        if out is not None:
            self._resolve(out)
        return out is not None

    def abort_tagged(self, tag: str) -> int:
        outs = self.engine.abort_tagged(tag)
        for out in outs:
            self._resolve(out)
        return len(outs)

    def abort_all(self) -> int:
        return self.abort_tagged("")

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def set_kv_reuse(self, enabled: bool) -> None:
        """The CPU engine's one benchmark switch (not part of the `Engine` protocol): parking off or on."""
        self.engine.set_kv_reuse(enabled)

    def hold(self) -> None:
        """Stop stepping, keeping every request and its KV cache where it is (SGLang's in-place pause);
        calls may still join, abort or update weights meanwhile."""
        self._held.clear()

    def release(self) -> None:
        self._held.set()

    def stats(self, drain: bool = True) -> EngineStats:
        return self.engine.stats(drain)

    def _resolve(self, out: GenerateOutput) -> None:
        fut = self._futures.pop(out.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(out)

    def _fail_alone(self) -> None:
        """Requests whose sampling failed in this step fail on their own; the others go on."""
        for rid, why in self.engine.failed.items():
            fut = self._futures.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(ValueError(why))
        self.engine.failed.clear()

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
            if not self._held.is_set():
                await self._held.wait()
                continue  # aborts may have emptied the engine meanwhile
            try:
                for out in self.engine.step():
                    self._resolve(out)
                self._fail_alone()
            except Exception as e:  # a broken step fails every caller loudly instead of hanging them
                for fut in self._futures.values():
                    if not fut.done():
                        fut.set_exception(e)
                self._futures.clear()
                self.engine.abort_all()
                raise
            # A call that arrives during a step needs a few loop turns to start running (Ray hands it
            # over from its own thread, then the task starts, then it reaches our code); one turn per
            # step made an abort wait two or three steps.
            for _ in range(YIELDS_PER_STEP):
                await asyncio.sleep(0)
