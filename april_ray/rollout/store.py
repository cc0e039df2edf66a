"""The partial-rollout store: interrupted groups (and surplus complete ones) between steps.

Groups keep their samples exactly as the engines left them: token ids, behaviour logprobs and the
policy version of every token. `take_partial` hands them back oldest first. The staleness bound applies
there, at the moment a group would be resumed: under `policy=restart` a sample whose oldest token is more
than `max_versions` versions behind restarts from its prompt (its tokens are counted as discarded); under
`mask` and `keep` it keeps its tokens (the learner masks what is stale under `mask`). Under
`task.reward_per_group` a finished sample of an unfinished group has no reward yet: its group is scored
when it completes (april_ray/rollout/engine_worker.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from april_ray.config import StalenessConfig
from april_ray.types import FinishReason, Group, HeldGroup, Sample, SampleMeta, SampleState


class PartialRolloutStore:
    def __init__(self, staleness: StalenessConfig = StalenessConfig()):
        self.staleness = staleness
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
            groups.append(self._restart_stale(g, version))
        return groups

    def _restart_stale(self, group: Group, version: int) -> Group:
        if not any(self._stale(s, version) for s in group.samples):
            return group
        return replace(group, samples=[self._restarted(s) if self._stale(s, version) else s for s in group.samples])

    def _stale(self, s: Sample, version: int) -> bool:
        """A partial sample the staleness policy restarts rather than resumes at `version`."""
        oldest = min(s.model_versions, default=version)
        return s.state == SampleState.PARTIAL and self.staleness.restarts(version - oldest)

    def _restarted(self, s: Sample) -> Sample:
        self.num_restarted_samples += 1
        return replace(s, num_discarded_tokens=s.num_discarded_tokens + s.num_model_tokens, response_ids=[],
                       logprobs=[], versions=[], loss_mask=None, episode=None, state=SampleState.QUEUED)

    def stats(self, version: int) -> dict:
        samples = [s for g in self.partial.values() for s in g.samples]
        oldest = [version - min(s.model_versions) for s in samples if s.model_versions]
        return {"store/groups": len(self.partial), "store/complete_groups": len(self.complete),
                "store/tokens": sum(len(s.response_ids) for s in samples),
                "store/max_age": max(oldest, default=0),
                "store/restarted_samples": self.num_restarted_samples}

    def __len__(self) -> int:
        return len(self.partial) + len(self.complete)

    def state_dict(self) -> dict:
        """Plain JSON values (no pickle): every sample with its ids, logprobs, versions, state and reward."""
        return {"partial": [group_to_json(g) for g in self.partial.values()],
                "complete": [group_to_json(g) for g in self.complete],
                "num_restarted_samples": self.num_restarted_samples}

    def load_state_dict(self, state: dict, where: str = "store") -> None:
        """Validates every field first (a ValueError names it, e.g. `store.partial[3].samples[0].logprobs`)
        and changes nothing when one is wrong."""
        _field(state, "partial", list, where)
        _field(state, "complete", list, where)
        partial = [group_from_json(g, f"{where}.partial[{i}]") for i, g in enumerate(state["partial"])]
        complete = [group_from_json(g, f"{where}.complete[{i}]") for i, g in enumerate(state["complete"])]
        restarted = _field(state, "num_restarted_samples", int, where)
        ids = [g.group_id for g in partial + complete]
        if len(ids) != len(set(ids)):
            raise ValueError(f"{where}: a group is stored twice: {sorted({i for i in ids if ids.count(i) > 1})}")
        for i, g in enumerate(partial):
            if g.is_complete:
                raise ValueError(f"{where}.partial[{i}]: group {g.group_id} is complete")
        for i, g in enumerate(complete):
            if not g.is_complete:
                raise ValueError(f"{where}.complete[{i}]: group {g.group_id} has unfinished samples")
            if any(s.reward is None for s in g.samples):
                raise ValueError(f"{where}.complete[{i}]: group {g.group_id} has a sample without a reward")
        self.partial = OrderedDict((g.group_id, g) for g in partial)
        self.complete = complete
        self.num_restarted_samples = restarted


# -- the store's state as JSON values ------------------------------------------------------------------
_SAMPLE_FIELDS = {"sample_id": str, "group_id": str, "prompt": str, "answer": str, "prompt_ids": list,
                  "max_response_len": int, "response_ids": list, "logprobs": list, "versions": list,
                  "state": str, "finish_reason": (str, type(None)), "reward": (float, int, type(None)),
                  "num_resumes": int, "num_discarded_tokens": int}


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _field(obj, key: str, kind, where: str):
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{where}.{key}: missing")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{where}.{key}: expected {_kind_name(kind)}, got {value!r:.60}")
    return value


def _numbers(values: list, kind, where: str) -> list:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, kind):
            raise ValueError(f"{where}[{i}]: expected {_kind_name(kind)}, got {v!r:.60}")
    return [float(v) for v in values] if kind != int else list(values)


def sample_to_json(s: Sample) -> dict:
    return {"sample_id": s.sample_id, "group_id": s.group_id, "prompt": s.prompt, "answer": s.answer,
            "prompt_ids": list(s.prompt_ids), "max_response_len": s.max_response_len,
            "response_ids": list(s.response_ids), "logprobs": list(s.logprobs), "versions": list(s.versions),
            "state": s.state.value, "finish_reason": s.finish_reason.value if s.finish_reason else None,
            "reward": s.reward, "num_resumes": s.num_resumes, "num_discarded_tokens": s.num_discarded_tokens,
            "loss_mask": None if s.loss_mask is None else list(s.loss_mask), "episode": s.episode,
            "metadata": s.metadata, "reward_error": s.reward_error}


def sample_from_json(d: dict, where: str) -> Sample:
    v = {k: _field(d, k, kind, where) for k, kind in _SAMPLE_FIELDS.items()}
    for key in ("prompt_ids", "response_ids", "versions"):
        v[key] = _numbers(v[key], int, f"{where}.{key}")
    v["logprobs"] = _numbers(v["logprobs"], (int, float), f"{where}.logprobs")
    n = len(v["response_ids"])
    for key in ("logprobs", "versions"):
        if len(v[key]) != n:
            raise ValueError(f"{where}.{key}: {len(v[key])} values for {n} response tokens")
    try:
        v["state"] = SampleState(v["state"])
        v["finish_reason"] = FinishReason(v["finish_reason"]) if v["finish_reason"] is not None else None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if v["state"] == SampleState.RUNNING:
        raise ValueError(f"{where}.state: a stored sample cannot be running")
    v["reward"] = float(v["reward"]) if v["reward"] is not None else None
    extra = _episode_fields(d, n, where)
    model = n if extra["loss_mask"] is None else sum(extra["loss_mask"])
    if model > v["max_response_len"]:
        raise ValueError(f"{where}.response_ids: {model} model tokens over max_response_len {v['max_response_len']}")
    return Sample(**v, **extra, reward_error=_optional_str(d, "reward_error", where))


def _optional_str(d: dict, key: str, where: str) -> str | None:
    """A text field a store of an older april-ray did not write (absent: None)."""
    value = d.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string or null, got {value!r:.60}")
    return value


def _episode_fields(d: dict, n: int, where: str) -> dict:
    """The fields a multi-turn sample adds; absent (a single-turn sample's store) means none."""
    mask, episode, metadata = d.get("loss_mask"), d.get("episode"), d.get("metadata", {})
    if mask is not None:
        mask = _numbers(_field(d, "loss_mask", list, where), int, f"{where}.loss_mask")
        if len(mask) != n or any(m not in (0, 1) for m in mask):
            raise ValueError(f"{where}.loss_mask: expected {n} values of 0 or 1")
    if episode is not None:
        _field(d, "episode", dict, where)
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}.metadata: expected an object, got {type(metadata).__name__}")
    return {"loss_mask": mask, "episode": episode, "metadata": metadata}


def group_to_json(g: Group) -> dict:
    """`Group.engine` is left out: the parked KV caches it points at do not outlive the engines."""
    return {"group_id": g.group_id, "prompt_index": g.prompt_index, "created_step": g.created_step,
            "samples": [sample_to_json(s) for s in g.samples]}


def group_from_json(d: dict, where: str) -> Group:
    gid = _field(d, "group_id", str, where)
    samples = [sample_from_json(s, f"{where}.samples[{i}]") for i, s in enumerate(_field(d, "samples", list, where))]
    if not samples:
        raise ValueError(f"{where}.samples: a group has at least one sample")
    for i, s in enumerate(samples):
        if s.group_id != gid:
            raise ValueError(f"{where}.samples[{i}].group_id: {s.group_id!r} in group {gid!r}")
    return Group(gid, _field(d, "prompt_index", int, where), samples, _field(d, "created_step", int, where))


def held(group: Group, handles: list) -> HeldGroup:
    """`group` as the monitor takes it from the store: a handle per sample, and its meta."""
    metas = [replace(SampleMeta.of(s, 0), reward_error=s.reward_error) for s in group.samples]
    return HeldGroup(group.group_id, group.prompt_index, handles, metas, group.created_step, group.engine)


def resolve_groups(groups: list[Group], resolve, reward_errors: dict[str, str] | None = None) -> list[Group]:
    """Groups arrive with sample handles (object refs on Ray); the store keeps values, each with the reward
    error its meta reported (`reward_errors`, by sample id: the engine put it in the meta alone)."""
    errors = reward_errors or {}
    return [replace(g, samples=[with_reward_error(resolve(s), errors) for s in g.samples]) for g in groups]


def with_reward_error(sample: Sample, errors: dict[str, str]) -> Sample:
    error = errors.get(sample.sample_id)
    return sample if error is None or sample.reward_error == error else replace(sample, reward_error=error)
