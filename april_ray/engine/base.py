"""The engine protocol that rollout code talks to; CPU and SGLang backends implement it."""
from __future__ import annotations

from typing import Protocol

from april_ray.types import EngineStats, GenerateOutput, GenerateRequest


class EngineFailure(RuntimeError):
    """An engine died; its in-flight samples are re-dispatched elsewhere."""


class EngineLeft(EngineFailure):
    """An engine is leaving (its node is preempted or drained): it handed back every partial sample with the
    tokens it had, and takes no more work. A graceful leave, not a crash: nothing of it was lost."""


class ServerError(RuntimeError):
    """An HTTP call to an inference server failed: the message names the URL, the status and what the
    server said."""


class BadRequestError(ServerError, ValueError):
    """The server refused the request (400): the request's own fault, as a ValueError from our engine is."""


class Engine(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate until stop, budget or abort; an aborted request returns its partial tokens."""

    def abort(self, request_id: str, park: bool = True) -> bool:
        """Abort one request; True if it was known. Idempotent. `park=False`: never keep its KV cache."""

    def abort_tagged(self, tag: str) -> int:
        """Abort every request whose id ends with `tag` (one rollout step's requests: `EngineWorker` ends
        each of them with the step's tag); returns how many were aborted. Idempotent."""

    def abort_all(self) -> int:
        """Abort every request, whoever sent it (a dying engine, a probe's end); returns how many were
        aborted. Idempotent."""

    def update_weights(self, state_dict, version: int) -> None:
        """Adopt new weights between steps; later tokens carry `version`."""

    def stats(self, drain: bool = True) -> EngineStats:
        """Counters, and the occupancy timeline since the last drain."""
