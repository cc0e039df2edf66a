"""The partial-rollout store: interrupted groups (and surplus complete ones) between steps.

Groups keep their samples exactly as the engines left them: token ids, behaviour logprobs and the
policy version of every token. `take_partial` hands them back oldest first. The staleness bound applies
there, at the moment a group would be resumed: a sample whose oldest token is more than `max_staleness`
versions behind either restarts from its prompt (its tokens are counted as discarded) or keeps its tokens
for the learner to mask (`stale_policy`).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

from april_ray.types import Group, SampleState


class PartialRolloutStore:
    def __init__(self, max_staleness: int, stale_policy: str = "restart"):
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.partial: OrderedDict[str, Group] = OrderedDict()
        self.complete: list[Group] = []
        self.num_restarted_samples = 0

    def put_partial(self, groups: list[Group]) -> None:
        for g in groups:
            assert g.group_id not in self.partial, f"group {g.group_id} stored twice"
            assert not g.is_complete
            self.partial[g.group_id] = g

    def put_complete(self, groups: list[Group]) -> None:
        """Surplus groups that completed in the same instant as the N-th: first in the next batch."""
        self.complete.extend(groups)

    def take_complete(self) -> list[Group]:
        groups, self.complete = self.complete, []
        return groups

    def take_partial(self, max_groups: int, version: int) -> list[Group]:
        groups = []
        while self.partial and len(groups) < max_groups:
            _, g = self.partial.popitem(last=False)
            if self.stale_policy == "restart":
                self._restart_stale(g, version)
            groups.append(g)
        return groups

    def _restart_stale(self, group: Group, version: int) -> None:
        for s in group.samples:
            if s.state == SampleState.PARTIAL and s.versions and version - s.versions[0] > self.max_staleness:
                s.num_discarded_tokens += len(s.response_ids)
                s.response_ids, s.logprobs, s.versions = [], [], []
                s.state = SampleState.QUEUED
                self.num_restarted_samples += 1

    def stats(self, version: int) -> dict:
        samples = [s for g in self.partial.values() for s in g.samples]
        oldest = [version - s.versions[0] for s in samples if s.versions]
        return {"store/groups": len(self.partial), "store/complete_groups": len(self.complete),
                "store/tokens": sum(len(s.response_ids) for s in samples),
                "store/max_age": max(oldest, default=0),
                "store/restarted_samples": self.num_restarted_samples}

    def __len__(self) -> int:
        return len(self.partial) + len(self.complete)

    def state_dict(self) -> dict:
        return {"partial": list(self.partial.values()), "complete": list(self.complete),
                "num_restarted_samples": self.num_restarted_samples}

    def load_state_dict(self, state: dict) -> None:
        self.partial = OrderedDict((g.group_id, g) for g in state["partial"])
        self.complete = list(state["complete"])
        self.num_restarted_samples = state["num_restarted_samples"]


def resolve_groups(groups: list[Group], resolve) -> list[Group]:
    """Groups arrive with sample handles (object refs on Ray); the store keeps values."""
    return [dataclasses.replace(g, samples=[resolve(s) for s in g.samples]) for g in groups]
