"""The prompt source: dataset rows, shuffled per epoch by seed, handed out as groups of samples.

Its cursor (epoch, position) is saved with every checkpoint together with the partial-rollout store, so
a restart neither skips the prompts that were waiting in the store nor repeats
any that were already returned.
"""
from __future__ import annotations

import random

from april_ray.task.data import Example
from april_ray.types import Group, Sample


class PromptSource:
    def __init__(self, examples: list[Example], encode, n_samples_per_prompt: int, max_response_len: int,
                 seed: int = 0):
        if not examples:
            raise ValueError("prompt source: the dataset is empty")
        self.examples = examples
        self.encode = encode
        self.n = n_samples_per_prompt
        self.max_response_len = max_response_len
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.num_groups_taken = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, num_groups: int, step: int = 0) -> list[Group]:
        groups = []
        for _ in range(num_groups):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            ex = self.examples[self._order[self.position]]
            groups.append(self._group(ex, f"e{self.epoch}p{self.position}", step))
            self.position += 1
        self.num_groups_taken += len(groups)
        return groups

    def _group(self, ex: Example, group_id: str, step: int) -> Group:
        ids = self.encode(ex.as_given)  # a PromptEncoder: the chat template, if the task uses one
        samples = [Sample(f"{group_id}s{i}", group_id, ex.prompt, ex.answer, ids, self.max_response_len,
                          metadata=ex.metadata) for i in range(self.n)]
        return Group(group_id, ex.index, samples, created_step=step)

    def state_dict(self) -> dict:
        """Plain JSON values: the cursor, and what it is only valid for (the dataset's size and the seed)."""
        return {"epoch": self.epoch, "position": self.position, "num_groups_taken": self.num_groups_taken,
                "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict, where: str = "source") -> None:
        """Validates every field first; a ValueError names it (e.g. `source.position`)."""
        if not isinstance(state, dict):
            raise ValueError(f"{where}: expected an object, got {type(state).__name__}")
        values = {}
        for key in ("epoch", "position", "num_groups_taken", "seed", "num_examples"):
            if key not in state:
                raise ValueError(f"{where}.{key}: missing")
            if isinstance(state[key], bool) or not isinstance(state[key], int) or (key != "seed" and state[key] < 0):
                raise ValueError(f"{where}.{key}: expected a non-negative integer, got {state[key]!r:.60}")
            values[key] = state[key]
        if values["num_examples"] != len(self.examples) or values["seed"] != self.seed:
            raise ValueError(f"{where}: the checkpoint was taken on a dataset of {values['num_examples']} rows with "
                             f"seed {values['seed']}; this job has {len(self.examples)} rows and seed {self.seed} "
                             f"(the rows are task.train_path's that fit engine.max_model_len less "
                             f"sampling.max_response_len, per task.overlong_prompts; the seed comes from task.seed "
                             f"and train.seed)")
        if values["position"] > len(self.examples):
            raise ValueError(f"{where}.position: {values['position']} is past the dataset's {len(self.examples)} rows")
        self.epoch, self.position = values["epoch"], values["position"]
        self.num_groups_taken = values["num_groups_taken"]
        self._order = self._shuffle(self.epoch)


def first_prompts(examples: list[Example], encode, seed: int, k: int) -> list[list[int]]:
    """The prompt ids of the first `k` prompts a source with this seed hands out: a benchmark's ceiling
    probe runs on the prompts its schedules run on (their response lengths, hence contexts, are the same)."""
    return [g.samples[0].prompt_ids for g in PromptSource(examples, encode, 1, 1, seed).take(k)]
