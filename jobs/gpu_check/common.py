"""What every part of the GPU check shares: the scale it runs at, the model shapes, random-initialised models
built from those shapes, the simulator's length mix and roofline for the card, and each part's deadline."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from april_ray.learn.plan import KNOWN_SHAPES

SHAPES = {name: KNOWN_SHAPES[name] for name in ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B")}
"""The published config.json shapes (april_ray/learn/plan.py): nothing is downloaded, the weights are random."""
SMOKE_SHAPES = {
    "Qwen3-0.6B": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, vocab_size=512, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True),
}
"""`--smoke`: the same roles, small enough for a CPU test."""

PAPER_BUDGET = 16384
"""configs/qwen3_4b_dapo.yaml's sampling.max_response_len, which the simulator's length mix is stated for."""


@dataclass(frozen=True)
class Scale:
    """How large the check runs. The simulator's length mix (sim/config.py's defaults, stated for a 16,384-token
    budget) is scaled by `length_scale`, every length alike, because our engine keeps a KV slot of
    max_model_len per row (no paging): 256 rows of the paper's 16k tokens would need ~490 GB at these shapes."""

    smoke: bool
    length_scale: float
    grid_rows: tuple[int, ...]
    """Concurrency of the uniform batches timed (the throughput curve)."""
    grid_contexts: tuple[int, ...]
    """Tokens per row of those batches."""
    grid_decode_steps: int
    mix_concurrency: tuple[int, ...]
    """Rows kept busy on the length mix (the engine's saturated throughput)."""
    probe_s: float
    rollout_groups: int
    """N per engine: the paper's 32 groups over 8 engines."""
    n_samples: int
    factors: tuple[float, ...]
    steps: int
    warmup_steps: int
    micro_batch_tokens: int
    """The learner's tokens per micro-batch (the paper's learner.micro_batch_tokens)."""
    sample_tokens: int
    """Tokens of each learner sample (prompt and response)."""
    updates: int
    """Weight handoffs timed."""

    @property
    def shapes(self) -> dict[str, dict]:
        return SMOKE_SHAPES if self.smoke else SHAPES

    @property
    def budget(self) -> int:
        return max(8, round(PAPER_BUDGET * self.length_scale))


GPU_SCALE = Scale(smoke=False, length_scale=1 / 32, grid_rows=(1, 8, 32, 64, 128, 256), grid_contexts=(64, 256, 512),
                  grid_decode_steps=8, mix_concurrency=(64, 256), probe_s=4.0, rollout_groups=4, n_samples=8,
                  factors=(1.5, 2.0), steps=6, warmup_steps=2, micro_batch_tokens=32768, sample_tokens=4096,
                  updates=5)
SMOKE_SCALE = Scale(smoke=True, length_scale=1 / 512, grid_rows=(1, 4, 8), grid_contexts=(8, 24), grid_decode_steps=3,
                    mix_concurrency=(8,), probe_s=0.5, rollout_groups=2, n_samples=4, factors=(1.5, 2.0), steps=2,
                    warmup_steps=1, micro_batch_tokens=256, sample_tokens=64, updates=2)


def simulate_defaults():
    """The simulator's own assumptions (`simulate.*` defaults: length mix, step overhead, efficiencies)."""
    from sim.config import SimulateConfig

    return SimulateConfig()


def length_mix(scale: Scale):
    """(the simulator's LengthModel scaled, prompt tokens, response budget): the same draws, sample by sample,
    as a simulation with the same seed makes (`sim/workload.py`)."""
    from sim.workload import LengthModel

    sim = simulate_defaults()
    lengths = LengthModel(sim.length_family, sim.length_median * scale.length_scale, sim.length_sigma,
                          sim.group_correlation, sim.seed, alpha=sim.length_alpha)
    return lengths, max(4, round(sim.prompt_len * scale.length_scale)), scale.budget


def accelerator_key(device_name: str) -> str:
    """sim/hardware.py's card for this device (h100 when it is none of those: a nominal roofline, said so)."""
    name = device_name.lower()
    return next((k for k in ("h200", "h100", "mi300x") if k in name), "h100")


def roofline(shape: dict, device_name: str):
    """The simulator's step cost of one engine of this shape on this card (sim/hardware.py, sim/config.py's
    efficiencies and step overhead)."""
    from sim.hardware import ACCELERATORS, gpu_step_cost, spec_from_hf

    sim = simulate_defaults()
    spec = spec_from_hf("model", shape | {"torch_dtype": "bfloat16"}, "april_ray/learn/plan.py KNOWN_SHAPES")
    acc = ACCELERATORS[accelerator_key(device_name)]
    return gpu_step_cost(spec, acc, 1, sim.step_overhead_s, sim.bandwidth_efficiency, sim.flops_efficiency)


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def build_model(shape: dict, device, dtype):
    """A random-initialised Qwen3 of `shape`, made on `device` (a GPU initialises billions of weights in
    seconds), in `dtype`, in eval mode."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=40960, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def model_dir(work: Path, name: str, shape: dict, device) -> Path:
    """A saved random model of `shape` (bf16) with the project's tokenizer (the learner reads its pad id),
    built once per run and shared by the parts that load from disk."""
    import torch

    from april_ray.task.tokenizer import build_tokenizer

    out = work / name
    if (out / "done").exists():
        return out
    model = build_model(shape, device, torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    del model
    free(device)
    (out / "done").write_text("")
    return out


def first_layers(full: Path, layers: int) -> Path:
    """A model directory of the first `layers` decoder layers of the one at `full`: its config cut, its files
    linked (loading skips the other layers' weights), so a smaller slice costs no new weights on disk."""
    out = full.parent / f"{full.name}_{layers}_layers"
    out.mkdir(exist_ok=True)
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config))
    for f in full.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    return out


def free(device) -> None:
    """Give back what dropped objects held: an engine and its step recorder refer to each other, so only the
    cycle collector frees a KV cache; then the allocator's cache goes back to the device."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Deadline:
    """A part's share of the budget: each unit of work starts only while `left()` is positive."""

    def __init__(self, at: float):
        self.at = at

    def left(self) -> float:
        return self.at - time.time()

    def passed(self) -> bool:
        return self.left() <= 0


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=float))
