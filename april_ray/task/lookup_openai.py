"""The embedded agent task's tool loop written as an ordinary OpenAI agent (`rollout.agent_fn`).

    python -m jobs.train --config configs/tiny_agent_cpu.yaml rollout.agent_fn=april_ray.task.lookup_openai:agent

The same loop as `lookup_countdown.episode`, through `openai.AsyncOpenAI` against the endpoint of its
engine (april_ray/rollout/agent_endpoint.py) instead of the episode handle: the model's turn ends at `?`
(a `stop` string), which the endpoint returns as a call of the one tool; call i looks up the prompt's i-th
key, and its answer goes back as a `role: tool` message; a turn without a call, or a call past the last
key, ends the episode, and the task's reward scores the whole response (the agent returns None). The tool
gets the endpoint's idempotency key of the turn (`X-April-Idempotency-Key`), the same on every replay.
"""
from __future__ import annotations

from april_ray.task.lookup_countdown import answer, lookup

MODEL = "policy"
IDEMPOTENCY_HEADER = "X-April-Idempotency-Key"
"""The endpoint's model name and idempotency header, as any agent would write them (a task never imports the
rollout package; tests/test_agent_endpoint.py holds them equal)."""

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The value of the prompt's next key, with the step to count down by.",
    "parameters": {"type": "object", "properties": {}}}}]


async def agent(base_url: str, api_key: str, row: dict, max_retries: int = 0) -> None:
    """Turns until one makes no tool call (or calls past the last key); returns None (the task's reward)."""
    from openai import AsyncOpenAI  # the `test` extra: a job without agents never imports it

    keys, step = row["prompt"].rstrip(":").rsplit("-", 1)
    keys = keys.split(",")
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=max_retries) as client:
        for turn in range(1, len(keys) + 2):
            raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                                         tools=TOOLS, stop=["?"])
            message = raw.parse().choices[0].message
            if not message.tool_calls or turn > len(keys):
                return None
            key = keys[turn - 1]
            value = lookup(row["sample_id"], turn, key, idempotency_key=raw.headers.get(IDEMPOTENCY_HEADER, ""))
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                          "content": answer(key, value, int(step))}]
    return None
