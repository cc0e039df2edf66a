"""What every channel that reaches servers does around a delivery: delivering to each server on its own (one
that fails is left out, to be caught up) and asking whether one answers. The pause and weight-update session
around a delivery is `engine.weight_handoff.weight_update`."""
from __future__ import annotations

import asyncio
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
