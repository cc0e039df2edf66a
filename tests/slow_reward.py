"""The countdown task's reward after a pause (`task.reward_fn=tests.slow_reward:countdown_after_a_pause`): a
step of the tiny model then lasts longer than twice Ray's metrics export interval, as a GPU step does
(tests/head_job.py). Async, so the samples' pauses overlap."""
import asyncio

from april_ray.task.countdown import countdown_reward

PAUSE_S = 4.5


async def countdown_after_a_pause(prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
    await asyncio.sleep(PAUSE_S)
    return countdown_reward(prompt, response)
