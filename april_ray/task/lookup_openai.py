"""The embedded agent task's tool loop written as an ordinary OpenAI agent (`rollout.agent_fn`).

    python -m jobs.train --config configs/tiny_agent_cpu.yaml rollout.agent_fn=april_ray.task.lookup_openai:agent

The same loop as `lookup_countdown.episode`, through `openai.AsyncOpenAI` against the endpoint of its
engine (april_ray/rollout/agent_endpoint.py) instead of the episode handle: the model's turn ends at `?`
(a `stop` string), which the endpoint returns as a call of the one tool; call i looks up the prompt's i-th
key, and its answer goes back as a `role: tool` message; a turn without a call, or a call past the last
key, ends the episode, and the task's reward scores the whole response (the agent returns None).

Each tool call is done once per trajectory: its result is kept in the job's tool journal under the turn's
idempotency key (the same on every replay of the same tokens), through the endpoint's `POST
/v1/april/journal`; a turn that calls the tool comes with the journal's answer for its key (`april_journal`,
an extra field of the response), so a replayed agent (its sample resumed on another engine, or after a driver
restart) takes the recorded result instead of calling the tool again, and a first call costs one request.

One client per event loop and endpoint, as OpenAI advises, each episode with its own key
(`with_options`): a client per episode built an HTTP client each time, whose loading of the CA bundle
(~0.1 s of CPU, on the engine's event loop where agents run) stalled decoding, the agent path's largest cost.
Its connect timeout is a minute, not openai's 5 s: the endpoint answers from the engine's busy loop.
"""
from __future__ import annotations

import asyncio
import weakref

import openai  # the `test` extra; only a job whose rollout.agent_fn is this loads it

from april_ray.task.lookup_countdown import answer, lookup

MODEL = "policy"
JOURNAL = "/april/journal"
JOURNAL_FIELD = "april_journal"
"""The endpoint's model name, journal route and the response's journal field, as any agent would write them
(a task never imports the rollout package; tests/test_agent_endpoint.py holds them equal)."""

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The value of the prompt's next key, with the step to count down by.",
    "parameters": {"type": "object", "properties": {}}}}]

_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Event loop -> base URL -> its client (a client's connections belong to one loop)."""


def client_for(base_url: str) -> openai.AsyncOpenAI:
    """The client of this event loop for the endpoint at `base_url`, made on first use and kept."""
    clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    if base_url not in clients:
        clients[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key="each episode gives its own",
                                               timeout=openai.Timeout(600.0, connect=60.0))
    return clients[base_url]


async def once(client: openai.AsyncOpenAI, recorded: dict, tool, *args):
    """`tool(*args, idempotency_key=key)` and its result journaled, unless the journal holds it under the turn's
    key already (`recorded`: the response's `april_journal`, `{"key"[, "value"]}`)."""
    if "value" in recorded:
        return recorded["value"]
    value = tool(*args, idempotency_key=recorded["key"])
    await client.post(JOURNAL, body={"key": recorded["key"], "value": value}, cast_to=dict)
    return value


async def agent(base_url: str, api_key: str, row: dict, max_retries: int = 0) -> None:
    """Turns until one makes no tool call (or calls past the last key); returns None (the task's reward)."""
    keys, step = row["prompt"].rstrip(":").rsplit("-", 1)
    keys = keys.split(",")
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    client = client_for(base_url).with_options(api_key=api_key, max_retries=max_retries)
    for turn in range(1, len(keys) + 2):
        completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stop=["?"])
        message = completion.choices[0].message
        if not message.tool_calls or turn > len(keys):
            return None
        key = keys[turn - 1]
        value = await once(client, completion.model_extra[JOURNAL_FIELD], lookup, row["sample_id"], turn, key)
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                      "content": answer(key, value, int(step))}]
    return None
