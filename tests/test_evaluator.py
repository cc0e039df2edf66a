"""The held-out evaluation's retries (driver/evaluator.py), with the engines' actors and Ray's settling
stood in for: which shard goes where, under which request ids."""
import driver.evaluator as evaluator


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

        def remote(self, items, temperature, tag):  # EngineWorker.evaluate's request ids: f"{tag}-{i}"
            ids = {f"{tag}-{i}" for i in range(len(items))}
            assert not ids & in_engine[self.e], f"engine {self.e}: request ids {sorted(ids & in_engine[self.e])} twice"
            in_engine[self.e] |= ids
            return [1.0] * len(items)

    class Engines:
        actors = [Actor(e) for e in range(4)]

        @staticmethod
        def serving():
            return [0]

    attempts = []

    def settle(refs):
        attempts.append(len(refs))
        return [r if i == 0 or len(attempts) > 1 else _Down() for i, r in enumerate(refs)]

    monkeypatch.setattr(evaluator, "settle", settle)
    e = object.__new__(evaluator.Evaluator)
    e.items, e.engines, e.calls, e.greedy = [("p", [1, 2], "a")] * 8, Engines(), 0, False
    assert e.accuracy(1.0) == 1.0
    assert attempts == [4, 3] and len(in_engine[0]) == 8
