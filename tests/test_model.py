"""The embedded tiny model: built locally, deterministic, cached, loaded like any HF checkpoint."""
import asyncio
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from april_ray.config import load_config
from april_ray.task.embedded_model import embedded_model_dir, ensure_model


def quick_cfg(cache, *extra):
    return load_config(None, [f"model.cache_dir={cache}", "warmup.steps=3", "task.num_train=200",
                              "task.num_eval=16", *extra])


def test_build_is_deterministic_cached_and_loads_with_from_pretrained(tmp_path):
    a = ensure_model(quick_cfg(tmp_path / "a"))
    b = ensure_model(quick_cfg(tmp_path / "b"))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(quick_cfg(tmp_path / "a")) == a  # reused, not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    assert embedded_model_dir(quick_cfg(tmp_path / "a", "warmup.seed=1")) != a  # other settings, other model
    model = AutoModelForCausalLM.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    assert type(model).__name__ == "Qwen3ForCausalLM" and sum(p.numel() for p in model.parameters()) <= 10_000_000
    assert tok.decode(tok.encode("0153-3:")) == "0153-3:"


@pytest.mark.slow
def test_default_warmup_accuracy_leaves_room_for_rl():
    """The default model (built once into the cache): clearly above 0, clearly below 100% at T=1. Built on
    2026-11-26 it scores 0.127 (greedy 0.252) on the 512 held-out prompts, the same through the code of
    `ab347ad` (its warm-up losses identical step for step), where BENCHMARKS' main-job run at `9f5c504`
    started from 0.258: the bound is below today's figure, not a claim that the drift is understood."""
    from jobs.build_model import held_out_accuracy

    cfg = load_config("configs/tiny_cpu.yaml", ["engine.max_num_seqs=256"])
    acc = asyncio.run(held_out_accuracy(cfg, ensure_model(cfg)))["accuracy_t1"]
    assert 0.08 <= acc <= 0.65, acc
