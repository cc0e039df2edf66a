"""Gathering ZeRO-3 weights with two learner ranks over gloo: every rank takes part (a gather that only rank 0
entered would hang), rank 0 gets the full state dict for the object store, and inside `full_weights` every
rank sees the full weights for a direct hand-over to inference servers."""
import pytest
import torch

from tests.ranks import run_ranks


def _rank(rank: int, world: int, port: int, model_dir: str, out: dict) -> None:
    import os

    from april_ray.config import AlgorithmConfig, LearnerConfig
    from april_ray.learn.learner import Learner

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    from tests.test_learner import batch_from_policy

    cfg = LearnerConfig(backend="deepspeed", zero_stage=3, lr=1e-3, logprob_chunk_tokens=4, gradient_checkpointing=True)
    learner = Learner(model_dir, cfg, AlgorithmConfig(), 1.0, 64, rank=rank, world_size=world, master_port=port)
    sizes = [p.numel() for p in learner.module.parameters()]  # partitioned: a share of each on this rank
    gathered = learner.state_dict()
    with learner.optim.full_weights() as named:
        full = {k: v.detach().clone() for k, v in named}
    # ranks with different token counts: the head's chunked calls (each one a ZeRO-3 gather) stay in lockstep
    metrics = learner.train_step(batch_from_policy(model_dir, n_groups=1, n=2 + 2 * rank), version=0)
    out[rank] = {"gathered": gathered, "full": full, "local_numel": sum(sizes), "grad_norm": metrics["train/grad_norm"]}


@pytest.mark.timeout(300)
def test_zero3_gather_runs_on_every_rank(random_model_dir):
    from transformers import AutoModelForCausalLM

    results = run_ranks(_rank, 2, str(random_model_dir))
    ref = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).state_dict()
    total = sum(v.numel() for k, v in ref.items() if k != "lm_head.weight")  # tied to the embedding
    assert all(results[r]["local_numel"] < total for r in range(2)), "ZeRO-3 did not partition the weights"
    assert set(results[0]["gathered"]) >= set(ref) - {"lm_head.weight"}
    for k, v in results[0]["gathered"].items():
        torch.testing.assert_close(v, ref[k])
    for r in range(2):
        assert set(results[r]["full"]) == set(ref) - {"lm_head.weight"}  # tied: the embedding is sent once
        assert results[r]["grad_norm"] > 0
        for k, v in results[r]["full"].items():
            torch.testing.assert_close(v, ref[k])
