"""What a simulated engine's step costs: the model's sizes, the accelerator's, and the step cost model.

A decode step of `rows` sequences whose KV caches hold `context` tokens together costs

    t = t0 + max(term(rows, context) for term in terms),   term = a + b * rows + c * context

On a GPU the terms are the roofline's two sides: reading the weights and the KV cache
(`weight_bytes / bw + context * kv_bytes_per_token / bw`) and the arithmetic
(`(2 * params * rows + 4 * layers * q_width * context) / flops`); a small model's decode is bound by the
first. A step also prefills the inputs admitted into it: per input token `2 * params / flops`, and per
(new token, earlier token) pair of causal attention `4 * layers * q_width / flops`. On the CPU engine the
terms are fitted to measured step times (`sim/calibrate.py`).

The sources of the constants are in the tables below; `bandwidth_efficiency` and `flops_efficiency` (what
a serving engine achieves of the datasheet's peak) are assumptions, set in `SimulateConfig`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> float:
        """q.k and the weighted sum of v for one (query, key) pair, every layer (2 flops a multiply-add)."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


# Architecture numbers as published in the model's config.json on its Hugging Face model card.
HF_CONFIGS = {
    "Qwen3-4B": ({"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
                 "huggingface.co/Qwen/Qwen3-4B config.json (model card: 4.0B parameters, 3.6B non-embedding)"),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def spec_from_hf(name: str, cfg: dict, source: str) -> ModelSpec:
    """Sizes of a dense decoder (Llama/Qwen layout: q, k, v, o projections, gated MLP) from its config.json."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2
    mlp = 3 * h * cfg["intermediate_size"]
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    params = layers * (attn + mlp + 2 * h + 2 * hd) + embed + h
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return ModelSpec(name, float(params), layers, heads, kv, hd, DTYPE_BYTES.get(str(dtype), 2), source)


def model_spec(path: str) -> ModelSpec:
    """The model at `path`: its config.json when the directory exists here, else the published numbers of a
    model in `HF_CONFIGS` named like the directory's last part."""
    config = Path(path) / "config.json"
    if config.is_file():
        return spec_from_hf(Path(path).name, json.loads(config.read_text()), str(config))
    name = Path(path).name
    if name in HF_CONFIGS:
        cfg, source = HF_CONFIGS[name]
        return spec_from_hf(name, cfg, source)
    raise ValueError(f"model.path: {path!r} has no config.json here, and {name!r} is not one of the models "
                     f"whose published sizes sim/hardware.py knows ({', '.join(HF_CONFIGS)})")


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: float
    bandwidth: float
    """Peak memory bandwidth, bytes/s."""
    flops: float
    """Peak dense bf16 FLOP/s (without sparsity)."""
    source: str


ACCELERATORS = {
    "h100": Accelerator("H100 SXM5", 80e9, 3.35e12, 989.4e12,
                        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense)"),
    "h200": Accelerator("H200 SXM", 141e9, 4.8e12, 989.4e12,
                        "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense)"),
    "mi300x": Accelerator("MI300X", 192e9, 5.3e12, 1307.4e12,
                          "AMD Instinct MI300X datasheet (OAM: 192 GB HBM3, 5.3 TB/s, 1307.4 TFLOPS bf16 dense)"),
}


@dataclass(frozen=True)
class StepCost:
    t0: float
    terms: tuple[tuple[float, float, float], ...]
    """(a, b, c): seconds, per running row, per token of context; a step costs t0 + the largest."""
    prefill_per_token: float
    prefill_per_pair: float
    """Causal attention of a prefill: per (new token, earlier or same token) pair."""
    prefill_per_step: float = 0.0
    """Fixed cost a step pays when it prefills anything (the CPU engine's prefill path; 0 on GPU)."""
    per_admitted: float = 0.0
    """Per request joining the batch: on the CPU engine its slot set-up, and (in the calibration) the CPU
    its front end, worker and monitor spend per request on the engine's one thread. 0 on GPU."""
    per_restored_token: float = 0.0
    """Per token of a parked KV cache copied back (the CPU engine's parking; 0 on GPU)."""
    per_aborted: float = 0.0
    """Engine time per aborted running request (the CPU engine parks its cache; in the calibration also
    the step boundary's other CPU per aborted request). 0 on GPU."""
    per_attended: float = 0.0
    """Per token of padded attention span (the CPU engine: each row attends over the longest context of
    its span class, `attended`; paged attention on GPU pads nothing: 0)."""

    def step(self, rows: int, context: float, attended: float = 0.0) -> float:
        return self.t0 + max(a + b * rows + c * context for a, b, c in self.terms) + self.per_attended * attended

    def decode_span(self, rows: int, context: float, n: int, attended: float = 0.0) -> float:
        """Exact time of n decode steps with the same rows, each adding `rows` tokens of context (and of
        padded span, from `attended` at the first step)."""
        if n <= 0:
            return 0.0
        terms = self.terms
        if len(terms) <= 2:  # the roofline's two sides, or one fitted line (taken twice): step j costs the
            # larger of u + v j and u2 + v2 j, each of the (at most) two ranges of j summed in closed form
            (a, b, c), (a2, b2, c2) = terms[0], terms[-1]
            u, v, u2, v2 = a + b * rows + c * context, c * rows, a2 + b2 * rows + c2 * context, c2 * rows
            total = self.t0 * n
            cut = math.ceil(x) if v != v2 and 0 < (x := (u2 - u) / (v - v2)) < n else n
            if cut > 0:
                mid = (cut - 1) / 2
                a, b = (u, v) if u + v * mid >= u2 + v2 * mid else (u2, v2)
                total += cut * a + b * (cut * (cut - 1) / 2)
            if n > cut:
                k = n - cut
                mid = (cut + n - 1) / 2
                a, b = (u, v) if u + v * mid >= u2 + v2 * mid else (u2, v2)
                total += k * a + b * (cut * k + k * (k - 1) / 2)
            if self.per_attended:
                total += self.per_attended * (attended * n + rows * n * (n - 1) / 2)
            return total
        lines = [(a + b * rows + c * context, c * rows) for a, b, c in terms]  # step j: u + v * j
        cuts = [0, n]  # steps j in [cut, next cut): one line is the largest
        for i, (u1, v1) in enumerate(lines):
            for u2, v2 in lines[i + 1:]:
                if v1 != v2 and 0 < (x := (u2 - u1) / (v1 - v2)) < n:
                    cuts.append(math.ceil(x))
        if len(cuts) > 2:
            cuts = sorted(set(cuts))
        total = self.t0 * n
        for j0, j1 in zip(cuts, cuts[1:]):
            if j1 > j0:
                mid = (j0 + j1 - 1) / 2
                u, v = max(lines, key=lambda l: l[0] + l[1] * mid)
                k = j1 - j0
                total += k * u + v * (j0 * k + k * (k - 1) / 2)
        if self.per_attended:
            total += self.per_attended * (attended * n + rows * n * (n - 1) / 2)
        return total

    def steps_within(self, rows: int, context: float, n: int, seconds: float, attended: float = 0.0) -> int:
        """How many of those n steps end within `seconds` (the span's time is increasing in steps).

        A step's cost is convex in its index (the largest of lines, plus a line), so it is at least its
        tangent at the first step: s0 + g j. Steps within `seconds` are then at most the root of
        s0 m + g m (m - 1) / 2 = seconds (plus one, for rounding), and the answer is that bound, or just
        under it, or found by bisection below it: the same answer as bisection over all n, from a couple
        of span costs instead of log2(n)."""
        lines = [(a + b * rows + c * context, c * rows) for a, b, c in self.terms]
        u, v = max(lines)  # the largest line at the first step (of those, the steepest)
        s0 = self.t0 + u + self.per_attended * attended
        g = v + self.per_attended * rows
        if not math.isfinite(seconds):  # (what the bisection gives: all steps for +inf, none for NaN)
            return n if seconds > 0 else 0
        hi = n
        if s0 > 0:  # the root of half m^2 + b m - seconds, in the form that keeps its digits when half << b
            half = g / 2
            b = s0 - half
            root = math.sqrt(b * b + 4 * half * seconds)
            bound = 2 * seconds / (b + root) if b > 0 else (root - b) / (2 * half)
            hi = min(n, max(0, int(bound) + 1))
        for m in (hi, hi - 1):  # the bound is the root rounded up: the answer is mostly one of these two
            if m < 0 or self.decode_span(rows, context, m, attended) <= seconds:
                return max(m, 0)
        lo, hi = 0, hi - 2  # further below: bisect there
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_span(rows, context, mid, attended) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def admission(self, inputs: list[tuple[int, int]], admitted: int = 0, restored: int = 0) -> float:
        """What a step adds for the requests it admits: the prefill of `inputs`, each given as (tokens
        already in the KV cache, tokens after prefill), `admitted` requests, `restored` cached tokens."""
        cost = self.per_admitted * admitted + self.per_restored_token * restored
        if not inputs:
            return cost
        if len(inputs) == 1:  # most admissions (the sums below, without their generators)
            (s, e), = inputs
            tokens, pairs = e - s, (e * (e + 1) - s * (s + 1)) / 2
        else:
            tokens = pairs = 0
            for s, e in inputs:
                tokens += e - s
                pairs += (e * (e + 1) - s * (s + 1)) / 2
        return cost + self.prefill_per_step + self.prefill_per_token * tokens + self.prefill_per_pair * pairs


def gpu_step_cost(model: ModelSpec, acc: Accelerator, tp: int, t0: float, bandwidth_efficiency: float,
                  flops_efficiency: float) -> StepCost:
    """The roofline of one engine of `tp` accelerators (tensor parallel: weights, KV cache, bandwidth and
    FLOP/s split evenly; the all-reduces are not modelled)."""
    bw = acc.bandwidth * bandwidth_efficiency * tp
    flops = acc.flops * flops_efficiency * tp
    memory = (model.weight_bytes / bw, 0.0, model.kv_bytes_per_token / bw)
    compute = (0.0, 2 * model.num_params / flops, model.attention_flops_per_pair / flops)
    return StepCost(t0, (memory, compute), 2 * model.num_params / flops, model.attention_flops_per_pair / flops)


def kv_capacity_tokens(model: ModelSpec, acc: Accelerator, tp: int, memory_fraction: float) -> int:
    """Tokens of KV cache an engine holds: its share of memory less the weights (SGLang's
    mem_fraction_static covers weights and KV pool; activations and CUDA graphs use the rest)."""
    free = acc.memory_bytes * tp * memory_fraction - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) does not fit "
                         f"{memory_fraction:.0%} of {tp} x {acc.name}")
    return int(free // model.kv_bytes_per_token)
