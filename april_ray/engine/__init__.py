"""Engine backends behind one protocol (`base.Engine`); the backend is chosen once, here."""
from __future__ import annotations

from april_ray.config import EngineConfig


def build_engine(cfg: EngineConfig, model_path: str, version: int = 0, stale_kv_versions: int = 0):
    """`stale_kv_versions`: how many versions old a parked KV cache may be and still be reused."""
    if cfg.backend == "cpu":
        import torch

        from april_ray.engine.async_engine import AsyncEngine
        from april_ray.engine.cpu_engine import LLMEngine
        from april_ray.model import load_policy

        torch.set_num_threads(cfg.num_threads)
        model, _ = load_policy(model_path)
        return AsyncEngine(LLMEngine(model, cfg.max_num_seqs, cfg.max_model_len, cfg.max_prefill_tokens,
                                     cfg.seed, version, cfg.park_slots, stale_kv_versions))
    raise NotImplementedError(f"engine.backend={cfg.backend}: this engine is not implemented in this build yet "
                              "(the SGLang backend is planned; use engine.backend=cpu)")
