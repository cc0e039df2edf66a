"""The memory plan of a learner GPU: will the config fit, before anything starts?

Arithmetic only (no torch): the model's shape (its config.json, or the published shape of a model named like
its directory), the learner's settings and the placement give each part of one GPU's memory at the
learner's peak, in two phases:
- train: the learner's forward and backward of its largest micro-batch. A colocated engine has released
  its weights and KV cache (`engine.weight_sync: tensor`), and keeps its process's context.
- rollout (colocated only): the engine's static pool (`engine.mem_fraction` of the GPU: weights and KV
  cache) beside what the learner keeps between steps (weights, master weights, gradients, optimiser states).

Activations per token and layer were measured on the HF Qwen3 decoder layer (tensors saved for backward,
fp32 and bf16, tests/test_plan.py keeps them honest); the logits of a chunk hold three fp32 copies of
[chunk x vocab] at the peak of its backward (the saved log-softmax, its gradient, the logits' gradient).
The plan is checked against measured peaks on CPU (`python -m jobs.bench.learner`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9

KNOWN_SHAPES = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
"""Published config.json shapes (huggingface.co/Qwen/<name>), for a plan made where the model is not."""

ACTIVATION_BYTES = {4: (24, 16, 16, 10), 2: (16, 8, 10, 7)}
"""Bytes saved for backward per token by one Qwen3 decoder layer, per unit of (hidden, intermediate,
q + kv width), and per unit of hidden outside the layers (embedding, final norm), by dtype size."""
LOGIT_COPIES = 3
"""fp32 [tokens x vocab] copies alive at a head chunk's peak (one more with a temperature other than 1)."""
CUDA_CONTEXT_GB = 0.6
"""A CUDA process's context and allocator slack (the learner's, and a colocated engine's)."""


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied: bool

    @classmethod
    def from_hf(cls, c: dict) -> "Shape":
        heads = c["num_attention_heads"]
        return cls(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads", heads), c.get("head_dim") or c["hidden_size"] // heads,
                   c["intermediate_size"], bool(c.get("tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h + 2 * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied else 2)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.hidden_size

    def activation_bytes_per_token(self, dtype_bytes: int) -> tuple[float, float]:
        """(one decoder layer, outside the layers) bytes saved for backward per token."""
        h_c, i_c, qkv_c, out_c = ACTIVATION_BYTES[dtype_bytes]
        qkv = (self.num_heads + self.num_kv_heads) * self.head_dim
        return h_c * self.hidden_size + i_c * self.intermediate_size + qkv_c * qkv, out_c * self.hidden_size


def model_shape(path: str) -> Shape:
    """The model at `path`: its config.json when the directory is here, else a known model named like the
    directory (a plan made on a machine without the weights)."""
    config = Path(path) / "config.json"
    if config.is_file():
        return Shape.from_hf(json.loads(config.read_text()))
    if Path(path).name in KNOWN_SHAPES:
        return Shape.from_hf(KNOWN_SHAPES[Path(path).name])
    raise ValueError(f"model.path: {path} has no config.json here and is not one of {', '.join(KNOWN_SHAPES)}")


@dataclass(frozen=True)
class LearnerSetting:
    """What shapes a learner rank's memory (from `LearnerConfig`, resolved for the device)."""

    dtype_bytes: int
    backend: str
    zero_stage: int
    num_ranks: int
    tokens: int
    """Tokens of the largest micro-batch (padded or packed)."""
    chunk_tokens: int
    """0: the head over every token at once."""
    checkpointing: bool
    temperature: float = 1.0


def learner_parts(shape: Shape, s: LearnerSetting) -> dict[str, float]:
    """Bytes of one learner rank at the peak of a step, by part."""
    p, n = shape.num_params, s.num_ranks
    zero = s.zero_stage if s.backend == "deepspeed" else 0
    shard = lambda stage: n if zero >= stage else 1  # noqa: E731  (a part partitioned from this ZeRO stage on)
    weight_bytes = s.dtype_bytes if s.backend == "deepspeed" else 4  # torch: autocast over fp32 weights
    parts = {"weights": p * weight_bytes / shard(3)}
    if s.backend == "deepspeed" and (s.dtype_bytes == 2 or zero >= 1):
        parts["master_weights"] = 4 * p / shard(1)  # fp32 partition of the optimiser (a copy, also in fp32)
    grads = p * weight_bytes / shard(2)
    if s.backend == "deepspeed" and s.dtype_bytes == 2:
        grads += 4 * p / shard(1)  # fp32 gradient partition beside the bf16 ones
    parts["gradients"] = grads
    parts["optimizer_states"] = 8 * p / shard(1)  # Adam's two fp32 moments
    if zero == 3:  # a layer gathered (and the next prefetched), the embedding gathered for the head
        head = shape.embedding_params / (1 if shape.tied else 2)
        parts["zero3_gathered"] = s.dtype_bytes * (2 * shape.layer_params + head)
    parts["activations"] = activation_bytes(shape, s.dtype_bytes, s.tokens)[s.checkpointing]
    # the head's positions split evenly into as few chunks as the chunk size allows (logprobs.num_chunks)
    rows = -(-s.tokens // -(-s.tokens // s.chunk_tokens)) if s.chunk_tokens > 0 else s.tokens
    copies = LOGIT_COPIES + (1 if s.temperature not in (0, 1) else 0)
    # bf16 adds nothing at the peak: the head's bf16 output is freed once `.float()` has copied it (neither the
    # cast nor the matmul keeps it for backward), and the bf16 gradient is made only after the log-softmax's
    # backward has freed its saved output and incoming gradient (H200: plan 3.41 GB against 2.71 GB measured)
    parts["logits"] = rows * shape.vocab_size * 4 * copies
    return parts


def activation_bytes(shape: Shape, dtype_bytes: int, tokens: int) -> dict[bool, float]:
    """Activations of a micro-batch, without (False) and with (True) checkpointing: with it, each layer's
    input is kept and one layer at a time is recomputed, its activations and their gradients alive."""
    layer, outside = shape.activation_bytes_per_token(dtype_bytes)
    return {False: tokens * (shape.num_layers * layer + outside),
            True: tokens * (shape.num_layers * shape.hidden_size * dtype_bytes + 2 * layer + outside)}


@dataclass
class MemoryPlan:
    parts: dict[str, float]
    """GB per GPU at the peak phase, by part."""
    phases: dict[str, float]
    """GB per GPU in each phase (train; rollout when colocated)."""
    gpu_memory_gb: float
    advice: str = ""
    notes: dict = field(default_factory=dict)
    """Figures behind the parts: activations with and without checkpointing, tokens, chunk size."""

    @property
    def peak_gb_per_gpu(self) -> float:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return self.peak_gb_per_gpu <= self.gpu_memory_gb

    def to_json(self) -> dict:
        return {"fits": self.fits, "peak_gb_per_gpu": round(self.peak_gb_per_gpu, 2),
                "gpu_memory_gb": self.gpu_memory_gb, "parts": {k: round(v, 3) for k, v in self.parts.items()},
                "phases": {k: round(v, 2) for k, v in self.phases.items()}, "advice": self.advice} | self.notes

    def report(self) -> str:
        lines = [f"  {name:<20} {gb:8.2f} GB" for name, gb in self.parts.items()]
        lines += [f"  {'phase ' + k:<20} {v:8.2f} GB" for k, v in self.phases.items()]
        lines += [f"  ({k}: {v})" for k, v in self.notes.items()]
        verdict = (f"fits: peak {self.peak_gb_per_gpu:.1f} GB of {self.gpu_memory_gb:.0f} GB per GPU" if self.fits else
                   f"does NOT fit: peak {self.peak_gb_per_gpu:.1f} GB of {self.gpu_memory_gb:.0f} GB per GPU. "
                   f"{self.advice}")
        return "\n".join(["memory per learner GPU:", *lines, verdict])


ADVICE = {
    "activations": ("learner.gradient_checkpointing=true", "a smaller learner.micro_batch_tokens"),
    "logits": ("learner.logprob_chunk_tokens=1024", "a smaller learner.logprob_chunk_tokens"),
    "optimizer_states": ("learner.zero_stage=3", "more learner.num_ranks"),
    "master_weights": ("learner.zero_stage=3", "more learner.num_ranks"),
    "gradients": ("learner.zero_stage=3", "more learner.num_ranks"),
    "weights": ("learner.zero_stage=3", "more learner.num_ranks"),
    "engine_kv_pool": ("a smaller engine.mem_fraction", "a smaller engine.mem_fraction"),
    "reference_model": ("algorithm.kl_coef=0 (no reference model)", "algorithm.kl_coef=0 (no reference model)"),
}


def _advice(parts: dict[str, float], setting: LearnerSetting) -> str:
    """The setting that shrinks the largest part the config has not already shrunk."""
    done = {"learner.gradient_checkpointing=true": setting.checkpointing,
            "learner.logprob_chunk_tokens=1024": 0 < setting.chunk_tokens <= 1024,
            "learner.zero_stage=3": setting.zero_stage == 3 and setting.backend == "deepspeed"}
    for name, _ in sorted(parts.items(), key=lambda kv: -kv[1]):
        if name in ADVICE:
            first, then = ADVICE[name]
            return f"Largest part: {name} ({parts[name]:.1f} GB); set {then if done.get(first) else first}."
    return ""


def plan(cfg, shape: Shape, gpu_memory_gb: float, dtype_bytes: int = 2) -> MemoryPlan:
    """The plan of one learner GPU for `cfg` (a `Config`), its model of `shape`, on GPUs of `gpu_memory_gb`."""
    lc = cfg.learner
    setting = LearnerSetting(dtype_bytes, lc.backend, lc.zero_stage, lc.num_ranks,
                             max(lc.micro_batch_tokens, cfg.engine.max_model_len), lc.logprob_chunk_tokens,
                             lc.gradient_checkpointing, cfg.sampling.temperature)
    parts = {k: v / GB for k, v in learner_parts(shape, setting).items()}
    if cfg.algorithm.kl_coef > 0:  # the KL's reference policy: whole on every rank, in the compute dtype
        parts["reference_model"] = shape.num_params * dtype_bytes / GB
    colocated = cfg.placement.colocate and cfg.engine.backend == "sglang"
    if lc.gpus:
        parts["cuda_context"] = CUDA_CONTEXT_GB * (2 if colocated else 1)
    phases = {"train": sum(parts.values())}
    if colocated:
        released = cfg.engine.releases_memory  # the engines give their memory back while the learner trains
        kv_pool = cfg.engine.mem_fraction * gpu_memory_gb
        if not released:
            phases["train"] += kv_pool
        kept = sum(parts.get(k, 0.0) for k in ("weights", "master_weights", "gradients", "optimizer_states",
                                                 "reference_model"))
        phases["rollout"] = kept + kv_pool + parts.get("cuda_context", 0.0)
        parts["engine_kv_pool"] = kv_pool
    result = MemoryPlan(parts, phases, gpu_memory_gb)
    result.notes = {f"activations_{'with' if on else 'without'}_checkpointing": round(b / GB, 3)
                    for on, b in activation_bytes(shape, dtype_bytes, setting.tokens).items()}
    result.notes |= {"tokens_per_micro_batch": setting.tokens, "logits_chunk_tokens": setting.chunk_tokens,
                     "num_params": shape.num_params}
    if not result.fits:
        train_parts = {k: v for k, v in parts.items() if k != "engine_kv_pool"}
        if phases.get("rollout", 0) > phases["train"]:
            result.advice = (f"The rollout phase is the peak; set a smaller engine.mem_fraction "
                             f"(now {cfg.engine.mem_fraction}).")
        else:
            result.advice = _advice(train_parts, setting)
    return result
