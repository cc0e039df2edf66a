"""The learner on CPU without Ray: batch layout, advantages, a real optimiser step (torch and DeepSpeed)."""
from dataclasses import replace

import pytest
import torch

from april_ray.config import AlgorithmConfig, LearnerConfig, StalenessConfig
from april_ray.learn.learner import Learner, advantages_for, collate
from april_ray.learn.logprobs import token_logprobs
from april_ray.types import FinishReason, Sample, SampleState


def make_sample(gid, i, prompt, response, reward, version=0, logprobs=None):
    return Sample(f"{gid}/{i}", gid, "p", "a", prompt, 32, response_ids=response,
                  logprobs=logprobs if logprobs is not None else [-1.0] * len(response),
                  versions=[version] * len(response), state=SampleState.FINISHED,
                  finish_reason=FinishReason.STOP, reward=reward)


def test_collate_aligns_response_tokens_with_the_logits_that_predict_them():
    s = make_sample("g", 0, [5, 6, 7], [8, 9], 1.0, version=3, logprobs=[-0.1, -0.2])
    b = collate([s, make_sample("g", 1, [5], [6], 0.0)], pad_id=0)
    assert b["input_ids"][0].tolist() == [5, 6, 7, 8, 9]
    # logits at position t predict token t+1: response tokens 8, 9 are predicted at positions 2 and 3
    assert b["mask"][0].tolist() == [0, 0, 1, 1] and b["behaviour_logp"][0, 2:].tolist() == pytest.approx([-0.1, -0.2])
    assert b["versions"][0].tolist() == [0, 0, 3, 3]
    assert b["mask"][1].tolist() == [1, 0, 0, 0]


def test_advantages_are_normalised_within_each_group_and_overlong_shaped():
    samples = [make_sample("a", 0, [1], [2] * 4, 1.0), make_sample("a", 1, [1], [2] * 4, 0.0),
               make_sample("b", 0, [1], [2] * 4, 1.0), make_sample("b", 1, [1], [2] * 30, 1.0)]
    adv = advantages_for(samples, AlgorithmConfig(), max_response_len=32)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-4, rtol=0)
    shaped = advantages_for(samples, AlgorithmConfig(overlong_buffer=8), max_response_len=32)
    assert shaped[2] > 0 > shaped[3]  # the 30-token response is in the last 8 of the budget: penalised


def batch_from_policy(model_dir, n_groups=2, n=4):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    samples = []
    for gid in range(n_groups):
        prompt = torch.randint(3, 50, (5,), generator=g).tolist()
        for i in range(n):
            response = torch.randint(3, 50, (6 + i,), generator=g).tolist()
            with torch.no_grad():
                lp = token_logprobs(model, torch.tensor([prompt + response]), 1.0)[0, len(prompt) - 1:].tolist()
            samples.append(make_sample(f"g{gid}", i, prompt, response, float(i % 2), logprobs=lp))
    return samples


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo"])
def test_torch_learner_step_changes_weights_and_reports_metrics(random_model_dir, name):
    algo = {"grpo": AlgorithmConfig(), "dapo": AlgorithmConfig("dapo", 0.2, 0.28, "token_mean"),
            "gspo": AlgorithmConfig("gspo", 3e-4, 4e-4)}[name]
    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch", lr=1e-3, micro_batch_tokens=40),
                      algo, temperature=1.0, max_response_len=32)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    samples = batch_from_policy(random_model_dir)
    metrics = learner.train_step(samples, version=0)
    after = learner.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics["train/num_micro_batches"] > 1  # 40 padded tokens per micro-batch forces accumulation
    # behaviour logprobs came from the same weights: the recorded and recomputed logprobs agree
    assert metrics["train/behaviour_logp_gap"] < 1e-4 and metrics["off_policy/token_ratio"] == 0


def test_stale_tokens_are_reported_and_masked(random_model_dir):
    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch"), AlgorithmConfig(),
                      temperature=1.0, max_response_len=32, staleness=StalenessConfig(max_versions=1), seed=2)
    assert torch.initial_seed() == 17072  # 1234 + rank + 7919 x train.seed: what runs have always drawn with
    samples = batch_from_policy(random_model_dir)
    samples = [replace(s, versions=[0 if i < 4 else 3] * len(s.response_ids)) for i, s in enumerate(samples)]
    m = learner.train_step(samples, version=3)
    assert m["off_policy/token_ratio"] == pytest.approx(m["off_policy/masked_token_ratio"]) and m["off_policy/staleness_max"] == 3


def test_deepspeed_learner_single_rank_on_cpu(random_model_dir, tmp_path):
    learner = Learner(str(random_model_dir), LearnerConfig(backend="deepspeed", zero_stage=1, lr=1e-3),
                      AlgorithmConfig(), temperature=1.0, max_response_len=32, master_port=29731)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    learner.train_step(batch_from_policy(random_model_dir), version=0)
    after = learner.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    learner.save(tmp_path, str(random_model_dir))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    for k, v in after.items():  # the tied head is the embedding (only served names are published)
        torch.testing.assert_close(reloaded[k], v)
    torch.testing.assert_close(reloaded["lm_head.weight"], after["model.embed_tokens.weight"])
    assert (tmp_path / "optimizer" / "state").is_dir()
    # its parameters are views of DeepSpeed's flat buffers; the object-store channel puts their own bytes
    from april_ray.weights.object_store import ObjectStoreSender

    with learner.optim.full_weights() as named:
        named = list(named)
        assert any(t.untyped_storage().nbytes() > t.numel() * t.element_size() for _, t in named)
        sent = ObjectStoreSender(0, put=lambda obj: obj).send(named, [], version=1).weights
    assert sum(t.untyped_storage().nbytes() for t in sent.values()) == sum(t.numel() * t.element_size()
                                                                           for t in sent.values())
    torch.distributed.destroy_process_group()  # the learner's gloo group and its store, not left to the exit


def test_torch_learner_checkpoint_round_trip(random_model_dir, tmp_path):
    cfg = LearnerConfig(backend="torch", lr=1e-3)
    learner = Learner(str(random_model_dir), cfg, AlgorithmConfig(), temperature=1.0, max_response_len=32)
    learner.train_step(batch_from_policy(random_model_dir), version=0)
    learner.save(tmp_path, str(random_model_dir))
    again = Learner(str(random_model_dir), cfg, AlgorithmConfig(), temperature=1.0, max_response_len=32)
    again.load(tmp_path)
    for k, v in learner.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v)
    assert again.steps == 1 and again.optimizer.state_dict()["state"]


def gradients_of_one_step(learner, samples, version=0):
    """The gradients the optimiser would apply (its step replaced by a capture), and the step's metrics."""
    captured = {}

    def capture():
        captured.update({n: p.grad.clone() for n, p in learner.module.named_parameters() if p.grad is not None})
        learner.optimizer.zero_grad(set_to_none=True)
        return 0.0

    learner.optim.step = capture
    return captured, learner.train_step(samples, version)


def stale_batch(model_dir):
    """Policy-scored samples with varied lengths, behaviour logprobs shifted (so IS weights differ from 1)."""
    samples = batch_from_policy(model_dir, n_groups=3, n=4)
    return [replace(s, response_ids=s.response_ids + [7] * (3 * k),
                    logprobs=[lp - 0.1 * (k % 3) for lp in s.logprobs] + [-2.0] * (3 * k),
                    versions=[k % 2] * (len(s.response_ids) + 3 * k)) for k, s in enumerate(samples)]


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo"])
def test_loss_and_gradients_do_not_depend_on_the_micro_batching(random_model_dir, name):
    algo = {"grpo": AlgorithmConfig(), "dapo": AlgorithmConfig("dapo", 0.2, 0.28, "token_mean"),
            "gspo": AlgorithmConfig("gspo", 3e-4, 4e-4)}[name]
    samples = stale_batch(random_model_dir)
    results = []
    for budget, spread in ((1 << 20, 1e9), (60, 1.2), (200, 2.0)):
        learner = Learner(str(random_model_dir), LearnerConfig(backend="torch", micro_batch_tokens=budget,
                                                               max_spread=spread), algo, 1.0, 32, staleness=StalenessConfig(max_versions=0))
        results.append(gradients_of_one_step(learner, samples, version=1))
    (one, m_one), *others = results
    assert m_one["train/num_micro_batches"] == 1
    for grads, m in others:
        assert m["train/num_micro_batches"] > 2
        assert m["loss/policy"] == pytest.approx(m_one["loss/policy"], rel=1e-5, abs=1e-7)
        for k in one:
            torch.testing.assert_close(grads[k], one[k], rtol=1e-4, atol=1e-7)


def test_two_minibatches_take_two_steps_against_the_proximal_policy(random_model_dir):
    samples = batch_from_policy(random_model_dir)
    cfg = LearnerConfig(backend="torch", lr=5e-3, num_minibatches=2)
    algo = AlgorithmConfig("dapo", 0.2, 0.28, "token_mean")
    learner = Learner(str(random_model_dir), cfg, algo, temperature=1.0, max_response_len=32)
    ratios = []
    real_step = learner.optim.step

    def step():  # record each mini-batch's ratio as the loss saw it, then step for real
        ratios.append(learner_metrics[-1])
        return real_step()

    learner_metrics = []
    loss = learner._loss

    def recording_loss(*args):
        policy, kl, metrics = loss(*args)
        learner_metrics.append(metrics["loss/ratio_mean"])
        return policy, kl, metrics

    learner._loss, learner.optim.step = recording_loss, step
    m = learner.train_step(samples, version=0)
    assert learner.steps == 2 and m["train/num_minibatches"] == 2
    # the first mini-batch sees the proximal weights (ratio 1); the second sees weights one step on
    assert ratios[0] == pytest.approx(1.0, abs=1e-6) and abs(ratios[1] - 1.0) > 1e-4
    # the engines sampled with the proximal weights: the behaviour weight stays 1 in both steps
    assert m["train/behaviour_logp_gap"] < 1e-4


def test_one_minibatch_ratio_is_one_and_needs_no_extra_forward(random_model_dir):
    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch"), AlgorithmConfig(), 1.0, 32)
    calls = []
    learner.proximal_logprobs = lambda samples: calls.append(samples)
    m = learner.train_step(batch_from_policy(random_model_dir), version=0)
    assert not calls and m["loss/ratio_mean"] == pytest.approx(1.0) and m["loss/clip_fraction"] == 0.0


def test_proximal_logprobs_match_the_engines_when_the_weights_are_the_same(random_model_dir):
    samples = batch_from_policy(random_model_dir)
    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch", micro_batch_tokens=40), AlgorithmConfig(),
                      1.0, 32)
    for s, lp in zip(samples, learner.proximal_logprobs(samples)):
        torch.testing.assert_close(lp, torch.tensor(s.logprobs), rtol=0, atol=1e-5)


def test_off_policy_metrics_count_every_response_token_however_the_batch_is_cut(random_model_dir):
    """A micro-batch whose tokens are all masked as stale weighs 0 in the loss, but its tokens still count
    in the masked and off-policy ratios, and the staleness maximum is a maximum, not a mean."""
    from april_ray.types import FinishReason, SampleState

    def sample(i, n, version):
        return Sample(f"g{i // 2}s{i % 2}", f"g{i // 2}", "p", "a", [5, 6, 7], 64, response_ids=[9] * n,
                      logprobs=[-1.0] * n, versions=[version] * n, state=SampleState.FINISHED,
                      finish_reason=FinishReason.STOP, reward=float(i % 2))

    # fresh short samples (version 3) and stale long ones (version 0, older than staleness=StalenessConfig(max_versions=1))
    samples = [sample(0, 4, 3), sample(1, 4, 3), sample(2, 40, 0), sample(3, 40, 0)]
    metrics = {}
    for tokens, spread in ((1024, 100.0), (96, 2.0)):  # one micro-batch, then the fresh and the stale ones apart
        cfg = LearnerConfig(backend="torch", micro_batch_tokens=tokens, max_spread=spread)
        learner = Learner(str(random_model_dir), cfg, AlgorithmConfig(), 1.0, 64, staleness=StalenessConfig(max_versions=1))
        assert len(learner.micro_batches(samples)[0]) == (1 if tokens == 1024 else 2)
        metrics[tokens] = learner.train_step(samples, version=3)
    for m in metrics.values():
        assert m["off_policy/masked_token_ratio"] == pytest.approx(80 / 88)
        assert m["off_policy/token_ratio"] == pytest.approx(80 / 88)
        assert m["off_policy/staleness_max"] == 3


def test_checkpointing_chunks_and_packing_leave_the_gradients_unchanged(random_model_dir):
    """The memory options change how the step runs, never what it computes."""
    samples = stale_batch(random_model_dir)
    plain = LearnerConfig(backend="torch", micro_batch_tokens=80, logprob_chunk_tokens=0, packing="off")
    lean = replace(plain, logprob_chunk_tokens=5, gradient_checkpointing=True, packing="on")
    (want, m_want), (got, m_got) = [gradients_of_one_step(Learner(str(random_model_dir), cfg, AlgorithmConfig(), 0.8, 32),
                                                          samples) for cfg in (plain, lean)]
    assert m_got["loss/policy"] == pytest.approx(m_want["loss/policy"], rel=1e-5, abs=1e-7)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-7)


def test_bfloat16_with_the_torch_backend_keeps_fp32_masters_and_fp32_logprobs(random_model_dir):
    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch", dtype="bfloat16", lr=1e-3),
                      AlgorithmConfig(), temperature=1.0, max_response_len=32)
    samples = batch_from_policy(random_model_dir)
    assert learner.proximal_logprobs(samples)[0].dtype == torch.float32
    (grads, metrics), fp32 = gradients_of_one_step(learner, samples), Learner(
        str(random_model_dir), LearnerConfig(backend="torch"), AlgorithmConfig(), 1.0, 32)
    want, _ = gradients_of_one_step(fp32, samples)
    assert all(p.dtype == torch.float32 for p in learner.module.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values())
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads.values()]),
                                                torch.cat([want[k].flatten() for k in grads]), dim=0)
    assert cos > 0.98, cos  # bf16 matmuls: close to, not equal to, the fp32 gradient


def test_a_tied_head_is_never_sent_and_the_engine_takes_the_weights_without_it(random_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.weights.disk import save_for_disk_update
    from april_ray.learn.optim import served_names

    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch", lr=1e-2), AlgorithmConfig(), 1.0, 32)
    assert learner.module.config.tie_word_embeddings
    learner.train_step(batch_from_policy(random_model_dir), version=0)
    published = learner.state_dict()  # the object store's payload
    with learner.optim.full_weights() as named:  # what broadcast, tensor handoff and disk send
        sent = dict(named)
        save_for_disk_update(named, str(tmp_path / "weights"), str(random_model_dir))
    for names in (set(published), set(sent)):
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        assert not any("rotary_emb" in n for n in names)  # non-persistent buffers: never state
    from safetensors import safe_open

    with safe_open(str(tmp_path / "weights" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    engine_model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    LLMEngine(engine_model, max_num_seqs=2, max_model_len=64).update_weights(published, version=1)
    torch.testing.assert_close(engine_model.lm_head.weight, published["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="missing"):  # an untied tensor that is missing is still an error
        LLMEngine(engine_model, max_num_seqs=2, max_model_len=64).update_weights(
            {k: v for k, v in published.items() if k != "model.norm.weight"}, version=2)
    untied = AutoModelForCausalLM.from_config(replace_config(engine_model.config, tie_word_embeddings=False))
    assert "lm_head.weight" in served_names(untied)


def replace_config(config, **changes):
    copy = type(config).from_dict(config.to_dict())
    for k, v in changes.items():
        setattr(copy, k, v)
    return copy


def _bf16_rank(rank: int, world: int, port: int, model_dir: str, out: dict) -> None:
    import os

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    learner = Learner(model_dir, LearnerConfig(backend="deepspeed", zero_stage=1, lr=1e-2, dtype="bfloat16"),
                      AlgorithmConfig(), temperature=1.0, max_response_len=32, master_port=port)
    masters = learner.optimizer.single_partition_of_fp32_groups
    before = [m.clone() for m in masters]
    samples = batch_from_policy(model_dir)
    out["proximal_dtype"] = str(learner.proximal_logprobs(samples)[0].dtype)
    metrics = learner.train_step(samples, version=0)
    out.update(module_dtypes={str(p.dtype) for p in learner.module.parameters()},
               master_dtypes={str(m.dtype) for m in masters}, grad_norm=metrics["train/grad_norm"],
               masters_moved=any(not torch.equal(b, m) for b, m in zip(before, masters)))


@pytest.mark.timeout(300)
def test_deepspeed_bfloat16_trains_bf16_weights_from_fp32_masters(random_model_dir):
    from tests.ranks import run_ranks

    out = run_ranks(_bf16_rank, 1, str(random_model_dir))  # a rank process: one default group per process
    assert out["module_dtypes"] == {"torch.bfloat16"} and out["master_dtypes"] == {"torch.float32"}
    assert out["proximal_dtype"] == "torch.float32" and out["grad_norm"] > 0 and out["masters_moved"]
