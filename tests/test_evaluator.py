"""Evaluation (driver/evaluator.py, april_ray/task/evaluate.py): the retries, with the engines' actors and
Ray's settling stood in for (which shard goes where, under which request ids); the evaluation sets'
pass@k against its definition; a set read from a file outside the repository, end to end on fakes."""
import itertools
import json

import pytest

import driver.evaluator as evaluator
from april_ray.config import load_config
from april_ray.task.evaluate import ks, pass_at_k, set_metrics


class _Down(Exception):
    """An engine that died mid-call (what `settle` returns for one)."""


def test_a_retry_that_puts_several_shards_on_one_engine_gives_each_its_own_request_ids(monkeypatch):
    """3 of 4 engines die in the first attempt; the one left scores the other three shards at once. An
    engine refuses a request id it already holds (the CPU scheduler raises), so the ids must differ
    between shards, not only between attempts."""
    in_engine: dict[int, set[str]] = {e: set() for e in range(4)}

    class Actor:
        def __init__(self, e):
            self.e, self.evaluate = e, self

        def remote(self, items, temperature, tag, top_p):  # EngineWorker.evaluate's request ids: f"{tag}-{i}"
            ids = {f"{tag}-{i}" for i in range(len(items))}
            assert not ids & in_engine[self.e], f"engine {self.e}: request ids {sorted(ids & in_engine[self.e])} twice"
            in_engine[self.e] |= ids
            return [(1.0, 3)] * len(items)

    class Engines:
        actors = [Actor(e) for e in range(4)]

        @staticmethod
        def present():  # every engine placed (a fixed fleet)
            return list(range(4))

        @staticmethod
        def serving():
            return [0]

    attempts = []

    def settle(refs):
        attempts.append(len(refs))
        return [r if i == 0 or len(attempts) > 1 else _Down() for i, r in enumerate(refs)]

    monkeypatch.setattr(evaluator, "settle", settle)
    e = object.__new__(evaluator.Evaluator)
    e.items, e.engines, e.calls, e.greedy = [("p", [1, 2], "a", {})] * 8, Engines(), 0, False
    assert e.accuracy(1.0) == 1.0
    assert attempts == [4, 3] and len(in_engine[0]) == 8


def test_pass_at_k_is_the_unbiased_estimator():
    """Against its definition: the chance that a k-subset of the n responses holds a correct one."""
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    assert pass_at_k(16, 4, 1) == 4 / 16 and ks(16) == [1, 2, 4, 8, 16] and ks(1) == [1] and ks(6) == [1, 2, 4, 6]


def test_set_metrics_from_n_responses_per_prompt():
    # two prompts, 4 responses each: 1 of 4 right, then all 4 right
    results = [(1.0, 10), (0.0, 20), (0.0, 30), (0.0, 40)] + [(1.0, 4)] * 4
    m = set_metrics("aime", results, 4, pass_reward=1.0)
    assert m["eval/aime/pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["eval/aime/pass@4"] == 1.0 and m["eval/aime/pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["eval/aime/reward_mean"] == 5 / 8 and m["eval/aime/response_len"] == (100 + 16) / 8
    assert set_metrics("x", [(0.5, 1)], 1, pass_reward=0.5)["eval/x/pass@1"] == 1.0


class FakeEngines:
    """Engine actors whose `evaluate` answers per item: reward 1 when the prompt's answer, read from the
    item, is even, for the first `right` responses of the call (so the order of results matters)."""

    def __init__(self, num: int):
        self.calls = []
        engines = self

        class Actor:
            class evaluate:
                @staticmethod
                def remote(items, temperature, tag, top_p):
                    engines.calls.append((len(items), temperature, top_p))
                    return [(float(int(answer) % 2 == 0), len(prompt)) for prompt, ids, answer, meta in items]

        self.actors = [Actor() for _ in range(num)]

    def present(self):
        return list(range(len(self.actors)))

    def serving(self):
        return list(range(len(self.actors)))

    def stats(self, drain):
        pass


def test_evaluation_sets_from_files_outside_the_repository(tmp_path, monkeypatch, random_model_dir):
    """eval.datasets read with their own keys (metadata kept), n responses per prompt at eval.temperature and
    eval.top_p, sharded over 3 engines and put back in order; the held-out keys are still there."""
    monkeypatch.setattr(evaluator, "settle", lambda refs: refs)
    rows = [{"question": "q" * (i + 1), "final_answer": i, "source": "s"} for i in range(5)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "0006-3:", "answer": "2"}) + "\n")
    cfg = load_config(None, ["eval.datasets.deepmath.path=" + str(tmp_path / "math.jsonl"),
                             "eval.datasets.deepmath.prompt_key=question", "eval.datasets.deepmath.answer_key=final_answer",
                             "eval.n_samples_per_prompt=4", "eval.temperature=0.6", "eval.top_p=0.95",
                             "train.eval_greedy=false"])
    engines = FakeEngines(3)
    e = evaluator.Evaluator(cfg, engines, str(random_model_dir), str(tmp_path / "heldout.jsonl"))
    assert [item[3] for item in e.sets["deepmath"]] == [{"source": "s"}] * 5
    out = e.run(3)
    assert out["eval/accuracy_t1"] == 1.0 and "eval/accuracy_greedy" not in out and out["eval/version"] == 3
    assert out["eval/deepmath/pass@1"] == pytest.approx(3 / 5) and out["eval/deepmath/pass@4"] == pytest.approx(3 / 5)
    assert out["eval/deepmath/response_len"] == pytest.approx(3.0)  # q..qqqqq, 4 times each
    assert sorted(engines.calls[-3:]) == [(6, 0.6, 0.95), (7, 0.6, 0.95), (7, 0.6, 0.95)]  # 20 responses, 3 shards
    bad = load_config(None, ["eval.datasets.aime.path=" + str(tmp_path / "none.jsonl")])
    with pytest.raises(ValueError, match="eval.datasets.aime.path: dataset not found"):
        evaluator.Evaluator(bad, engines, str(random_model_dir), str(tmp_path / "heldout.jsonl"))
