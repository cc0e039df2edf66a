"""PromptSource actor: a shell around `april_ray.rollout.prompt_source.PromptSource`."""
from __future__ import annotations

import ray

from april_ray.config import TaskConfig
from april_ray.rollout.prompt_source import PromptSource


@ray.remote(num_cpus=0)
class PromptSourceActor:
    def __init__(self, data_path: str, task: TaskConfig, model_path: str, n_samples: int, max_response_len: int,
                 seed: int, max_prompt_tokens: int):
        """The dataset at `data_path`, read with `task`'s keys, chat template and overlong-prompt policy;
        `seed` orders the prompts; prompts must fit in `max_prompt_tokens`."""
        from april_ray.task.chat import PromptEncoder
        from april_ray.task.data import fit_context, read_examples
        from april_ray.task.tokenizer import load_tokenizer

        tok = load_tokenizer(model_path)
        encode = PromptEncoder(tok, task, f"the tokenizer of {model_path}")
        examples = fit_context(read_examples(data_path, task.prompt_key, task.answer_key, task.metadata_keys), encode,
                               max_prompt_tokens, task.overlong_prompts, "task.overlong_prompts",
                               unk_id=tok.unk_token_id)
        self.source = PromptSource(examples, encode, n_samples, max_response_len, seed)

    def take(self, num_groups: int, step: int):
        return self.source.take(num_groups, step)

    def num_groups_taken(self) -> int:
        return self.source.num_groups_taken

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)
