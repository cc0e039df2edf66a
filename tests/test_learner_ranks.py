"""Two DeepSpeed learner ranks over gloo whose shares of a batch cut into different numbers of
micro-batches: ZeRO-2 and -3 communicate in every micro-batch, so the ranks must agree on how many they
run (a rank with fewer repeats its last, weighed 0). Before they did, the collectives of the two ranks went
out of step ("Received data size doesn't match expected size")."""
import pytest

from tests.ranks import run_ranks


def _rank(rank: int, world: int, port: int, model_dir: str, stage: int, out: dict) -> None:
    import os

    from april_ray.config import AlgorithmConfig, LearnerConfig
    from april_ray.types import FinishReason, Sample, SampleState

    from april_ray.learn.learner import Learner

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    cfg = LearnerConfig(backend="deepspeed", zero_stage=stage, lr=1e-3, micro_batch_tokens=64, max_spread=2.0)
    learner = Learner(model_dir, cfg, AlgorithmConfig(), 1.0, 64, rank=rank, world_size=world, master_port=port)
    # rank 0: responses of one length (one micro-batch); rank 1: lengths 2..40 (several micro-batches)
    lengths = [8] * 4 if rank == 0 else [2, 5, 11, 40]
    samples = [Sample(f"r{rank}s{i}", f"r{rank}", "p", "a", [5, 6, 7], 64, response_ids=[9] * n,
                      logprobs=[-1.0] * n, versions=[0] * n, state=SampleState.FINISHED,
                      finish_reason=FinishReason.STOP, reward=float(i % 2)) for i, n in enumerate(lengths)]
    own = learner.micro_batches(samples)[1]
    metrics = learner.train_step(samples, version=0)
    out[rank] = {"own": own, "num_micro_batches": metrics["train/num_micro_batches"],
                 "mismatch": {k: v for k, v in metrics.items() if k.startswith("mismatch/")}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_ranks_with_different_micro_batch_counts_step_together(random_model_dir, stage):
    results = run_ranks(_rank, 2, str(random_model_dir), stage)
    assert results[0]["own"] < results[1]["own"], results  # the case under test: the cuts differ
    assert [results[r]["num_micro_batches"] for r in range(2)] == [results[r]["own"] for r in range(2)]
    # the mismatch by token age is summed over the ranks: each returns the whole batch's, the same keys
    assert results[0]["mismatch"] == results[1]["mismatch"] and results[0]["mismatch"]["mismatch/num_tokens"] == 32 + 58


def _grad_rank(rank: int, world: int, port: int, model_dir: str, aggregation: str, out: dict) -> None:
    import os

    from april_ray.config import AlgorithmConfig, LearnerConfig
    from april_ray.learn.learner import Learner

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    cfg = LearnerConfig(backend="deepspeed", zero_stage=2, lr=1e-3, micro_batch_tokens=64, max_spread=2.0)
    learner = Learner(model_dir, cfg, AlgorithmConfig("dapo", 0.2, 0.28, aggregation), 1.0, 64, rank=rank,
                      world_size=world, master_port=port)
    out[rank] = learner.train_step(_uneven_groups()[rank], version=0)["train/grad_norm"]


def _uneven_groups():
    """Two groups of unequal sizes and lengths: rank 0 gets 2 short samples, rank 1 four long ones."""
    from april_ray.types import FinishReason, Sample, SampleState

    def group(g, lengths):
        return [Sample(f"g{g}s{i}", f"g{g}", "p", "a", [5, 6, 7], 64, response_ids=[9 + i] * n,
                       logprobs=[-1.0] * n, versions=[0] * n, state=SampleState.FINISHED,
                       finish_reason=FinishReason.STOP, reward=float(i % 2)) for i, n in enumerate(lengths)]

    return [group(0, [2, 3]), group(1, [30, 12, 40, 21])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_two_ranks_with_unequal_shares_take_the_whole_batchs_gradient(random_model_dir, aggregation):
    """DAPO's token mean weighs every token of the batch the same (GRPO's sequence mean every sequence),
    whichever rank holds it: the gradient of two DeepSpeed ranks holding 5 and 103 tokens (2 and 4
    sequences) is that of one rank holding all of them. Normalised over each rank's own units, as before,
    it was not (the ranks' gradients are averaged: the short group weighed as much as the long one)."""
    from april_ray.config import AlgorithmConfig, LearnerConfig
    from april_ray.learn.learner import Learner

    two = run_ranks(_grad_rank, 2, str(random_model_dir), aggregation)
    one = Learner(str(random_model_dir), LearnerConfig(backend="torch", lr=1e-3, micro_batch_tokens=64,
                                                       max_spread=2.0),
                  AlgorithmConfig("dapo", 0.2, 0.28, aggregation), 1.0, 64)
    whole = one.train_step([s for g in _uneven_groups() for s in g], version=0)["train/grad_norm"]
    assert two[0] == pytest.approx(two[1], rel=1e-6)  # DeepSpeed's norm is the global one
    assert two[0] == pytest.approx(whole, rel=1e-4), (two, whole)
