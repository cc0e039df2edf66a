"""The learner's optimiser backends, one class each, chosen once when the learner is built.

Both wrap the policy and expose the same operations: forward through `model` (inside `autocast()`),
`backward` of one micro-batch's loss, `step` at the end of a batch (returns the gradient norm),
`full_state_dict` (full weights on CPU for the engines and for saving), `full_weights` (every rank sees the
full weights in place, for a direct hand-over to inference servers), and `save` / `load` of the optimiser
state. Both weight views hold what a server's model has (`served_names`): no tied alias, no
non-persistent buffer.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from april_ray.config import LearnerConfig
from april_ray.learn.safe_state import deepspeed_checkpoint_engine, load_state, save_state
from april_ray.process_groups import init_default_group

OPTIMIZER_FILE = "optimizer.safetensors"


def served_names(module) -> set[str]:
    """The state-dict names an inference server's model has: each tensor under its first name only. A tied
    head (`lm_head.weight` when `tie_word_embeddings`) is the embedding under a second name: SGLang's loader
    drops it, and for Qwen3-4B it is 0.78 GB of every update. The state dict already leaves out
    non-persistent buffers (rotary frequencies), which the server computes itself."""
    first: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        first.setdefault(id(t), name)
    return set(first.values())


def _served(named, served: set[str]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in named if n in served]


class TorchOptim:
    """Plain torch AdamW on one rank; bfloat16 runs the forward under autocast over the fp32 weights."""

    def __init__(self, model, cfg: LearnerConfig, dtype: torch.dtype = torch.float32):
        self.model = self.module = model
        self.cfg, self.dtype = cfg, dtype
        self.served = served_names(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.steps = 0

    def autocast(self):
        """bf16 matmuls over fp32 master weights (the optimiser and its states stay fp32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(next(self.module.parameters()).device.type, dtype=self.dtype)

    def lockstep(self, n: int) -> int:
        """One rank: its own count."""
        return n

    def backward(self, loss: torch.Tensor, is_last: bool) -> None:
        loss.backward()

    ranks_averaged = 1
    """How many ranks' gradients `step` averages (one rank: its own)."""

    def over_ranks(self, values: list[float], op: str) -> list[float]:
        """One rank: its own values."""
        return list(values)

    def most_of_any_rank(self, n: int) -> int:
        return n

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in _served(self.module.state_dict().items(), self.served)}

    @contextlib.contextmanager
    def full_weights(self):
        yield _served(self.module.state_dict().items(), self.served)

    def save(self, path: Path, rank: int) -> None:
        if rank == 0:
            save_state({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, path / OPTIMIZER_FILE)

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        # With tied embeddings save_pretrained stores embed_tokens and not lm_head: allow only that gap.
        missing, unexpected = self.module.load_state_dict(load_file(path / "policy" / "model.safetensors"), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{path}/policy does not match the policy (missing {missing}, unexpected {unexpected})")
        state = load_state(path / OPTIMIZER_FILE)  # tensors and JSON: never unpickled
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]


class DeepSpeedOptim:
    """DeepSpeed ZeRO 0-3 (gloo on CPU, NCCL/RCCL on GPU) over the data-parallel ranks."""

    def __init__(self, model, cfg: LearnerConfig, rank: int, world_size: int, master_port: int,
                 dtype: torch.dtype = torch.float32):
        self.served = served_names(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.model, self.optimizer = init_deepspeed(model, optimizer, cfg, rank, world_size, master_port, dtype)
        self.module = self.model.module
        self.cfg = cfg

    def autocast(self):
        """Nothing to do: with bf16 DeepSpeed holds the module in bf16 and the fp32 masters in the optimiser."""
        return contextlib.nullcontext()

    def lockstep(self, n: int) -> int:
        """How many calls of a module every rank makes where each rank needs `n`: under ZeRO-3 every call
        gathers the module's weights, a collective that every rank must join as often."""
        return self.most_of_any_rank(n) if self.cfg.zero_stage == 3 else n

    @property
    def steps(self) -> int:
        return self.model.global_steps

    @property
    def ranks_averaged(self) -> int:
        """DeepSpeed averages the ranks' gradients (their sum over the data-parallel world size): a loss
        normalised over the whole batch is scaled by this on each rank for the average to be its gradient."""
        import torch.distributed as dist

        return dist.get_world_size()

    def over_ranks(self, values: list[float], op: str) -> list[float]:
        """`values` reduced element-wise over the data-parallel ranks: op "sum", "max" or "min" (every rank
        must call it, with as many values)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.model.device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def most_of_any_rank(self, n: int) -> int:
        """The largest `n` over the data-parallel ranks. ZeRO-2/3 communicate in every micro-batch's
        forward or backward (gradient reduce-scatter, parameter gathers), so every rank must run as many
        micro-batches as the rank with the most."""
        return int(self.over_ranks([n], "max")[0])

    def backward(self, loss: torch.Tensor, is_last: bool) -> None:
        self.model.set_gradient_accumulation_boundary(is_last)
        self.model.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Under ZeRO-3 the weights are partitioned: every rank must take part in gathering them, and only
        rank 0 receives them (the others get an empty dict)."""
        if self.cfg.zero_stage == 3:
            gathered = self.model._zero3_consolidated_16bit_state_dict()
            return {k: v.cpu() for k, v in _served((gathered or {}).items(), self.served)}
        return {k: v.detach().cpu().clone() for k, v in _served(self.module.state_dict().items(), self.served)}

    @contextlib.contextmanager
    def full_weights(self):
        """Every rank: the full weights, where they live, for the duration of the block (a ZeRO-3 rank
        gathers all partitions; every rank must enter)."""
        if self.cfg.zero_stage != 3:
            yield _served(self.module.state_dict().items(), self.served)
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.module.parameters())):
            yield _served(self.module.state_dict().items(), self.served)

    def save(self, path: Path, rank: int) -> None:
        self.model.checkpoint_engine = deepspeed_checkpoint_engine()  # safetensors, not torch.save's pickles
        self.model.save_checkpoint(str(path / "optimizer"), tag="state")
        if rank == 0:  # DeepSpeed's recovery scripts: code in a checkpoint, and they unpickle what they read
            for script in (path / "optimizer").glob("zero_to_*.py"):
                script.unlink()

    def load(self, path: Path) -> None:
        self.model.checkpoint_engine = deepspeed_checkpoint_engine()  # never unpickles
        self.model.load_checkpoint(str(path / "optimizer"), tag="state")


def build_optim(model, cfg: LearnerConfig, rank: int, world_size: int, master_port: int,
                dtype: torch.dtype = torch.float32):
    if cfg.backend == "deepspeed":
        return DeepSpeedOptim(model, cfg, rank, world_size, master_port, dtype)
    return TorchOptim(model, cfg, dtype)


def init_deepspeed(model, optimizer, cfg: LearnerConfig, rank: int, world_size: int, master_port: int,
                   dtype: torch.dtype = torch.float32):
    """A module-level function on purpose: Ray cannot pickle actor methods that touch `deepspeed.ops`."""
    import deepspeed

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": str(master_port)})
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skips a 40 s JIT build on CPU
    init_default_group("nccl" if on_gpu else "gloo", os.environ["MASTER_ADDR"], master_port, rank, world_size)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", auto_mpi_discovery=False)  # adopts it
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},  # bf16 module, fp32 masters and optimiser states
        "steps_per_print": 1 << 30,
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, opt
