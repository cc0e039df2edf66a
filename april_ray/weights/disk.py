"""The disk channel: rank 0 writes a safetensors directory (on storage every node sees) and every server
loads it (`/update_weights_from_disk`)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import torch

from april_ray.types import Delivery
from april_ray.weights.servers import send_to_each


class DiskSender:
    def __init__(self, rank: int, path: str, base_model_dir: str, flush_cache: bool):
        self.rank, self.path, self.base_model_dir, self.flush_cache = rank, path, base_model_dir, flush_cache

    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        if self.rank != 0:
            return Delivery()
        save_for_disk_update(named, self.path, self.base_model_dir)
        live = [c for c in clients if c is not None]
        return Delivery(loaded=tuple(asyncio.run(send_to_each(
            live, lambda c: c.update_weights_from_disk(self.path, self.flush_cache, version)))))


def save_for_disk_update(named: list[tuple[str, torch.Tensor]], out_dir: str, base_model_dir: str) -> None:
    """Write the weights as one safetensors file next to the base model's config files (a real SGLang
    server reads the config too). Tied tensors are written once, as safetensors requires."""
    from safetensors.torch import save_file

    out, seen, tensors = Path(out_dir), set(), {}
    out.mkdir(parents=True, exist_ok=True)
    for name, t in named:
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    for f in Path(base_model_dir).glob("*.json"):
        if not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
