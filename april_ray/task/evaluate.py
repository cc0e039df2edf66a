"""Held-out accuracy: sample one response per prompt and score it with the task's reward."""
from __future__ import annotations

from april_ray.data import Example
from april_ray.rewards import RewardFn
from april_ray.types import GenerateRequest, SamplingParams


def eval_requests(tokenizer, examples: list[Example], temperature: float, max_new_tokens: int):
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                        stop_token_ids=(tokenizer.eos_token_id,))
    return [GenerateRequest(f"eval-{ex.index}", tokenizer.encode(ex.prompt), sp) for ex in examples]


def score(tokenizer, examples: list[Example], outputs, reward_fn: RewardFn) -> float:
    """Mean reward; a response is its decoded ids without the stop token."""
    total = 0.0
    for ex, out in zip(examples, outputs):
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        total += reward_fn(ex.prompt, text, ex.answer)
    return total / max(1, len(examples))


def accuracy(engine, tokenizer, examples: list[Example], reward_fn: RewardFn, temperature: float,
             max_new_tokens: int) -> float:
    """With a synchronous `LLMEngine` (the warm-up job and tests); actors use eval_requests/score."""
    outputs = engine.generate(eval_requests(tokenizer, examples, temperature, max_new_tokens))
    return score(tokenizer, examples, outputs, reward_fn)
