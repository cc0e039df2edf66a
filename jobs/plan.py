"""The memory plan of a config's learner GPUs: does it fit, and if not, what to change.

    python -m jobs.plan --config configs/qwen3_4b_dapo.yaml [--json PATH] [key=value ...]

Prints per GPU: weights, gradients, optimiser states (by ZeRO stage and ranks), activations (with and
without checkpointing), the logits of a chunk, a colocated engine's KV pool, and the total against the
GPU's memory (the visible GPU's, else `learner.gpu_memory_gb`). `jobs.train` runs the same plan at start
when the learner uses GPUs and stops at once when it does not fit. Exits 1 when it does not fit.
"""
from __future__ import annotations

from april_ray.learn.plan import MemoryPlan, Shape, model_shape, plan
from jobs.common import parse, write_result


def shape_of(cfg) -> Shape:
    """`model.path`'s shape, or the embedded model's (its size from `model`, its character vocabulary)."""
    if cfg.model.path:
        return model_shape(cfg.model.path)
    from april_ray.task.tokenizer import build_tokenizer

    m = cfg.model
    return Shape(len(build_tokenizer()), m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                 m.intermediate_size, tied=True)


def learner_plan(cfg) -> MemoryPlan:
    """The plan for `cfg`'s learner GPUs: `learner.dtype` (auto: bf16 on GPUs, fp32 on CPU); the device's
    memory when one is visible."""
    import torch

    memory = cfg.learner.gpu_memory_gb
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory / 1e9
    fp32 = cfg.learner.dtype == "float32" or (cfg.learner.dtype == "auto" and not cfg.learner.gpus)
    return plan(cfg, shape_of(cfg), memory, dtype_bytes=4 if fp32 else 2)


def check_memory(cfg) -> None:
    """Stop before anything starts when the learner's GPUs cannot hold the plan (CPU learners: no check)."""
    if cfg.learner.gpus == 0:
        return
    try:
        result = learner_plan(cfg)
    except ValueError:  # a model whose shape is unknown here: loading it reports what is missing
        return
    if not result.fits:
        raise SystemExit(result.report())


def main() -> None:
    cfg, args = parse(__doc__, lambda p: p.add_argument("--json", help="write the plan as JSON here"))
    try:
        result = learner_plan(cfg)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(result.report())
    write_result(args.json, result.to_json())
    raise SystemExit(0 if result.fits else 1)


if __name__ == "__main__":
    main()
