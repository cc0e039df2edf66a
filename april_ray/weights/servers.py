"""What every channel that reaches servers does around a delivery: pause and weight-update sessions on a
set of servers, and delivering to each server on its own (one that fails is left out, to be caught up)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from april_ray.engine.base import BadRequestError

log = logging.getLogger(__name__)


async def send_to_each(clients, send_one) -> list[str]:
    """`send_one(client)` for every client at once; returns the URLs of those it succeeded for. A server that
    fails (its engine died or is restarting) is left out, to be caught up once back."""
    async def one(client) -> bool:
        try:
            await send_one(client)
            return True
        except RuntimeError as e:  # ServerError, ServerDied; a refused update (400) is a bug, raised
            if isinstance(e, BadRequestError):
                raise
            log.warning("weights to %s failed (%s: %s): left out", client.url, type(e).__name__, str(e)[:300])
            return False
        finally:
            await client.close()
    done = await asyncio.gather(*[one(c) for c in clients])
    return [c.url for c, ok in zip(clients, done) if ok]


async def answers(client, timeout_s: float = 10.0) -> bool:
    try:
        await asyncio.wait_for(client.health(), timeout_s)
        return True
    except (RuntimeError, asyncio.TimeoutError):
        return False


@contextlib.asynccontextmanager
async def weight_update(clients):
    """The servers paused in place (no request samples from half-updated weights) and inside a
    weight-update session (SGLang refuses tensor and distributed updates outside one) for the body. Every
    server that began a session ends it, and every server is told to continue, whatever happens (a pause or
    a begin that failed on one server, an error in the body): a server left paused holds every later
    request, one left in a session refuses the next begin. The first error goes on up."""
    async def on_all(call, among=clients) -> list:
        return await asyncio.gather(*[call(c) for c in among], return_exceptions=True)

    began: list = []
    try:
        raise_first(await on_all(lambda c: c.pause_generation("in_place")))
        opened = await on_all(lambda c: c.begin_weight_update())
        began = [c for c, r in zip(clients, opened) if not isinstance(r, BaseException)]
        raise_first(opened)
        yield
    except BaseException:
        await on_all(lambda c: c.end_weight_update(), began)
        await on_all(lambda c: c.continue_generation())
        raise
    raise_first(await on_all(lambda c: c.end_weight_update(), began)
                + await on_all(lambda c: c.continue_generation()))


def raise_first(results: list) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r
