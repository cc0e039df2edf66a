"""Engine backends behind one protocol (`base.Engine`); the backend is chosen once, here.

- cpu: our engine inside the engine actor (`AsyncEngine` over `LLMEngine`).
- cpu_http and sglang: an inference server started by the engine actor and spoken to over SGLang's HTTP
  API (`sglang_client.SGLangEngine`): our engine's own server (`http_server.py`), or `sglang.launch_server`
  on the actor's GPUs.

Our engine (both of its backends) runs on the GPU its actor was placed with, else on CPU (`engine_device`).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the HTTP server and the GPU tests import this package where omegaconf is absent
    from april_ray.config import EngineConfig


def build_engine(cfg: EngineConfig, model_path: str, version: int = 0, max_versions: int = 0, weights_root: str = ""):
    """`max_versions`: how many versions old a parked KV cache may be and still be reused. `weights_root`:
    where an HTTP server may load weights from disk besides the model's directory (engine.weight_sync=disk)."""
    return BACKENDS[cfg.backend](cfg, model_path, version, max_versions, weights_root)


def engine_device() -> str:
    """cuda when this process was placed with a GPU and torch can use it, else cpu. Ray names an actor's GPUs
    in CUDA_VISIBLE_DEVICES (a fraction of one included: placement.engine_gpus=0.5); an actor placed without
    one inherits the variable from whoever started Ray (usually unset). A server started by the actor
    inherits it too."""
    if not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _cpu_engine(cfg: EngineConfig, model_path: str, version: int, max_versions: int, weights_root: str):
    """(`weights_root` is for servers: this engine takes weights in memory only.)"""
    import torch

    from april_ray.engine.async_engine import AsyncEngine
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.engine.qwen3 import load_qwen3

    torch.set_num_threads(cfg.num_threads)
    model = load_qwen3(model_path)
    model.to(engine_device())  # the runner, its KV cache and its sampler follow the model's device
    return AsyncEngine(LLMEngine(model, cfg.max_num_seqs, cfg.max_model_len, cfg.max_prefill_tokens,
                                 cfg.seed, version, num_park_slots=cfg.park_slots, max_versions=max_versions))


def server_options(cfg: EngineConfig, model_path: str, version: int, max_versions: int, weights_root: str):
    """The configured server's options: our server on this process's device (SGLang takes the actor's GPUs
    by itself)."""
    from april_ray.engine.sglang_server import ServerOptions

    return ServerOptions(model_path, host=cfg.host, tp_size=cfg.tp_size, mem_fraction=cfg.mem_fraction,
                         memory_saver=cfg.releases_memory, max_num_seqs=cfg.max_num_seqs,
                         max_model_len=cfg.max_model_len, max_prefill_tokens=cfg.max_prefill_tokens,
                         num_threads=cfg.num_threads, seed=cfg.seed, park_slots=cfg.park_slots,
                         max_versions=max_versions, device=engine_device(), startup_timeout_s=cfg.startup_timeout_s,
                         weight_version=str(version), weights_root=weights_root)


def _http_engine(cfg: EngineConfig, model_path: str, version: int, max_versions: int, weights_root: str):
    """Start the configured server in this process's resources (Ray's CUDA_VISIBLE_DEVICES is inherited)
    and return its client. Call it from a thread that lives as long as the server should: the server
    is told to die with that thread (an actor's constructor runs on its main thread)."""
    from april_ray.engine.sglang_client import SGLangEngine
    from april_ray.engine.sglang_server import LAUNCHERS

    server = LAUNCHERS[cfg.backend]().start(server_options(cfg, model_path, version, max_versions, weights_root))
    return SGLangEngine(server.url, version, cfg.max_model_len, server, flush_on_update=max_versions == 0,
                        bucket_mb=cfg.weight_bucket_mb)


BACKENDS = {"cpu": _cpu_engine, "cpu_http": _http_engine, "sglang": _http_engine}
