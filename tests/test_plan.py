"""The learner's memory plan: the paper's configs fit an 80 GB GPU with their memory options and not without;
its activation figures match the tensors a Qwen3 layer saves; its peak matches a measured step."""
from pathlib import Path

import pytest
import torch

from april_ray.config import load_config
from april_ray.learn.plan import Shape
from jobs.plan import check_memory, learner_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["dapo", "grpo", "gspo"])
def test_the_paper_configs_fit_an_80gb_gpu_only_with_checkpointing_and_chunks(name):
    path = str(CONFIGS / f"qwen3_4b_{name}.yaml")
    result = learner_plan(load_config(path)).to_json()
    assert {"fits", "peak_gb_per_gpu", "gpu_memory_gb", "parts"} <= set(result)
    assert result["fits"] and result["peak_gb_per_gpu"] <= 80 and result["gpu_memory_gb"] == 80
    assert {"weights", "gradients", "optimizer_states", "activations", "logits", "engine_kv_pool"} <= set(result["parts"])
    off = learner_plan(load_config(path, ["learner.gradient_checkpointing=false", "learner.logprob_chunk_tokens=0"]))
    assert not off.fits and "learner.gradient_checkpointing=true" in off.report()
    no_chunks = learner_plan(load_config(path, ["learner.logprob_chunk_tokens=0"]))
    assert not no_chunks.fits and "learner.logprob_chunk_tokens" in no_chunks.advice


def test_a_gpu_job_that_does_not_fit_stops_before_it_starts_and_a_cpu_job_is_never_held():
    gpu = load_config(str(CONFIGS / "qwen3_4b_dapo.yaml"), ["learner.gradient_checkpointing=false"])
    with pytest.raises(SystemExit, match="does NOT fit"):
        check_memory(gpu)
    assert check_memory(load_config(str(CONFIGS / "tiny_cpu.yaml"), ["learner.micro_batch_tokens=100000000"])) is None


def saved_bytes_per_layer_token(shape: Shape, dtype: torch.dtype, tokens: int = 128) -> float:
    """Bytes a Qwen3 decoder layer saves for backward per token: two layers' worth minus one."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def saved(layers: int) -> int:
        cfg = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=layers,
                          num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                          head_dim=shape.head_dim, intermediate_size=shape.intermediate_size, use_cache=False)
        model = Qwen3ForCausalLM(cfg).to(dtype).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(0, shape.vocab_size, (1, tokens)))
        return sum(seen.values())

    return (saved(2) - saved(1)) / tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_figures_match_the_tensors_a_qwen3_layer_saves(dtype):
    shape = Shape(256, 96, 2, 6, 2, 16, 320, tied=True)
    planned, _ = shape.activation_bytes_per_token(4 if dtype == torch.float32 else 2)
    assert planned == pytest.approx(saved_bytes_per_layer_token(shape, dtype), rel=0.1)


@pytest.mark.timeout(900)
def test_the_plan_matches_a_measured_learner_step():
    """A process of its own per measurement (jobs.bench.learner), a small model with a 32k vocabulary."""
    import tempfile

    from jobs.bench.learner import build_model_dir, in_subprocess, predicted_bytes

    with tempfile.TemporaryDirectory() as work:
        model_dir = build_model_dir("tiny", 32_000, Path(work) / "tiny")
        for option in ("both_off", "both_on"):
            got = in_subprocess("measure", model_dir=str(model_dir), option=option, tokens=1536, vocab=32_000, threads=1)
            assert predicted_bytes("tiny", 32_000, option, 1536) == pytest.approx(got["peak_bytes"], rel=0.25)
