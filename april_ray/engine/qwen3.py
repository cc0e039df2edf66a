"""A Qwen3 checkpoint as the engine holds it: its parameters under the Hugging Face module's names and shapes,
read from config.json and the safetensors files without transformers' modeling code (whose import is most of
an engine process's start). The forward is `model_runner.ModelRunner`'s; this module only holds the weights,
so a weight update by name (`load_state_dict`) and the runner's reads are those of `Qwen3ForCausalLM`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen3Spec:
    """The config.json fields the engine reads (as `model.config`), under their Hugging Face names."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict = field(hash=False)
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()

    @classmethod
    def read(cls, path: str | Path) -> "Qwen3Spec":
        """From a model directory: a ValueError naming config.json when it is not a Qwen3 the engine can run."""
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") != "qwen3":
            raise ValueError(f"{path / 'config.json'}: model_type {raw.get('model_type')!r}; the CPU engine runs "
                             f"Qwen3 (model_type 'qwen3') only")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{path / 'config.json'}: rope type {rope.get('rope_type', rope.get('type'))!r}; "
                             f"the CPU engine rotates by rope_theta alone ('default')")
        generation = path / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
        eos = raw.get("eos_token_id") if eos is None else eos
        heads = raw["num_attention_heads"]
        return cls(raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"], heads,
                   raw.get("num_key_value_heads") or heads, raw.get("head_dim") or raw["hidden_size"] // heads,
                   raw.get("rms_norm_eps", 1e-6), rope, raw.get("hidden_act", "silu"),
                   bool(raw.get("attention_bias", False)), bool(raw.get("tie_word_embeddings", False)),
                   tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))


def _meta(*shape: int) -> nn.Parameter:
    """A parameter with a shape and no storage: the checkpoint's tensor takes its place (`load_qwen3`). No
    initialisation runs (an init on meta tensors imports torch's compiler, seconds of an engine's start)."""
    return nn.Parameter(torch.empty(shape, device="meta"))


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = _meta(n_out, n_in)
        self.bias = _meta(n_out) if bias else None


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = _meta(num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _meta(dim)
        self.variance_epsilon = eps


class Attention(nn.Module):
    def __init__(self, c: Qwen3Spec):
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = Linear(c.hidden_size, q, c.attention_bias)
        self.k_proj = Linear(c.hidden_size, kv, c.attention_bias)
        self.v_proj = Linear(c.hidden_size, kv, c.attention_bias)
        self.o_proj = Linear(q, c.hidden_size, c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: Qwen3Spec):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, False)


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Spec):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, c: Qwen3Spec):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3Weights(nn.Module):
    """`Qwen3ForCausalLM`'s parameter tree (`model.embed_tokens`, `model.layers.N...`, `model.norm`, `lm_head`,
    the head tied to the embedding when the config says so) and its `config`, without a forward."""

    def __init__(self, config: Qwen3Spec):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def load_qwen3(path: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3Weights:
    """The checkpoint at `path` (model.safetensors, or shards under model.safetensors.index.json) in `dtype`,
    on the CPU; every parameter loaded, or a ValueError naming the missing, unexpected or misshapen tensors."""
    from safetensors.torch import load_file

    path = Path(path)
    config = Qwen3Spec.read(path)
    index = path / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    tensors = {}
    for shard in shards:
        tensors.update(load_file(str(path / shard)))
    tensors = {k: v.to(dtype) for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    model = Qwen3Weights(config)
    expected = dict(model.named_parameters())  # a tied head is named by the embedding alone
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{path}: its weights are not a Qwen3 of its config.json (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    wrong = [f"{k} {tuple(tensors[k].shape)} where config.json makes {tuple(p.shape)}" for k, p in expected.items()
             if tensors[k].shape != p.shape]
    if wrong:
        raise ValueError(f"{path}: its weights are not a Qwen3 of its config.json ({'; '.join(wrong[:3])})")
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
