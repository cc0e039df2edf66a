"""One typed config tree: a dataclass per component, nested under `Config`.

Loading is OmegaConf's structured merge (schema, then a YAML file, then `key=value` overrides), so an
unknown key or a wrong type fails at start with the key's full name. `validate()` then checks values and
cross-field rules, and raises `ConfigError` naming the key. Each actor gets only its own section, and
nothing writes to the tree after validation.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    pass


def default_cache_dir() -> str:
    return os.environ.get("APRIL_RAY_CACHE", str(Path.home() / ".cache" / "april_ray"))


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face directory of the policy. Empty: build (or reuse) the embedded tiny model in cache_dir."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Where the embedded model and task data are built and cached ($APRIL_RAY_CACHE overrides)."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 1024


@dataclass
class WarmupConfig:
    """Supervised warm-up that turns a random tiny model into a policy worth RL-training."""

    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    num_threads: int = 2
    seed: int = 0


@dataclass
class LengthConfig:
    """Distribution of the number of countdown terms; a response is about 5 tokens per term."""

    family: str = "lognormal"
    """lognormal (median, sigma), pareto (median as scale x_m, alpha), exponential (median), uniform."""
    median: float = 6.0
    sigma: float = 1.0
    alpha: float = 1.2
    min_terms: int = 1
    max_terms: int = 100


@dataclass
class TaskConfig:
    name: str = "countdown"
    """countdown: the embedded synthetic task. math: answers checked with math-verify."""
    train_path: str = ""
    """JSONL or Parquet with prompt and answer fields. Empty: generate the countdown task in cache_dir."""
    eval_path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    num_train: int = 20000
    num_eval: int = 256
    seed: int = 1234
    max_step: int = 3
    """Countdown steps are drawn from 1..max_step; larger steps make the arithmetic harder."""
    length: LengthConfig = field(default_factory=LengthConfig)


@dataclass
class EngineConfig:
    backend: str = "cpu"
    """cpu: the embedded continuous-batching engine. sglang: SGLang servers on GPU nodes."""
    max_num_seqs: int = 64
    """Concurrency cap: sequences in the running batch (and KV-cache slots)."""
    max_model_len: int = 640
    """Prompt plus response tokens per sequence (KV-cache length)."""
    max_prefill_tokens: int = 8192
    """Prompt tokens admitted per step; bounds a step's latency (and so abort latency)."""
    num_threads: int = 1
    """torch intra-op threads per engine."""
    seed: int = 0
    park_slots: int = 0
    """cpu: spare KV-cache slots that keep aborted sequences' caches, so a resumed sample skips its
    re-prefill (oldest evicted first). 0: every resume re-runs its prefix."""
    kv_reuse_max_staleness: int = 0
    """cpu: how many policy versions older than the current weights a parked cache may be and still be
    reused. 0: only caches the current weights computed (exact). k > 0: a resumed sample keeps the keys
    and values older weights computed for its prefix (PipelineRL-style); its new tokens' behaviour
    logprobs are still exactly what sampled them, so truncated IS corrects for it."""


@dataclass
class RolloutConfig:
    """APRIL's knobs. One group = n_samples_per_prompt samples of one prompt."""

    rollout_batch_size: int = 16
    """N: complete groups per step (what the learner trains on)."""
    over_sampling_batch_size: int = 32
    """N': groups kept in flight until N are complete (APRIL only; the sync baseline uses N)."""
    n_samples_per_prompt: int = 8
    max_response_len: int = 512
    """Response budget per sample, summed over all its resumes."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    partial_rollout: bool = True
    """true: APRIL (over-provision, interrupt, recycle). false: the synchronous baseline."""
    max_staleness: int = 4
    """A partial sample whose oldest token is more than this many versions old is handled by stale_policy."""
    stale_policy: str = "keep"
    """restart: drop its tokens and start again from the prompt. keep: keep them (the learner may mask)."""
    dynamic_filter: bool = False
    """DAPO dynamic sampling: drop complete groups whose rewards all agree, and refill their slots."""
    max_filtered_groups: int = 256
    """A step fails (with every sample kept in the store) once the filter has dropped more groups than this."""
    num_engines: int = 2
    abort_resend_s: float = 2.0
    """Re-send the abort if requests are still outstanding after this long (aborts are idempotent)."""


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """grpo, dapo or gspo. Presets below are GRPO's; configs/ sets DAPO's and GSPO's published values."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """DAPO's clip-higher uses 0.28; GSPO clips the sequence ratio at about 3e-4 / 4e-4."""
    loss_aggregation: str = "seq_mean_token_mean"
    """token_mean (DAPO) or seq_mean_token_mean (GRPO as published); GSPO averages over sequences."""
    normalize_adv_std: bool = True
    kl_coef: float = 0.0
    """Weight of k3 KL to the reference model (the warm-up policy); 0 loads no reference model."""
    tis_cap: float = 2.0
    """Truncated importance sampling: per-token weight min(pi_old / pi_behaviour, tis_cap); 0 disables."""
    mask_older_than: int = -1
    """Mask tokens sampled more than this many versions ago out of the loss; -1 disables."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: penalise the last this-many tokens of the budget linearly down to -1; 0 disables."""


@dataclass
class LearnerConfig:
    backend: str = "deepspeed"
    """deepspeed (ZeRO; gloo on CPU, NCCL/RCCL on GPU) or torch (plain AdamW, one rank)."""
    num_ranks: int = 1
    """Data-parallel world size: one learner actor per rank."""
    zero_stage: int = 1
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward micro-batch."""
    num_threads: int = 2
    gpus: int = 0
    """GPUs per learner rank."""
    cpus: float = 1.0


@dataclass
class TrainConfig:
    num_steps: int = 60
    eval_every: int = 10
    save_every: int = 20
    resume: bool = False
    """Continue from the latest checkpoint in output_dir (policy, optimizer, cursor, store, version)."""
    output_dir: str = "outputs/train"
    eval_greedy: bool = True


@dataclass
class PlacementConfig:
    """How actors map onto the cluster: one placement group, a bundle per engine (and learner rank)."""

    strategy: str = "PACK"
    """PACK, SPREAD, STRICT_PACK or STRICT_SPREAD (Ray placement-group strategies)."""
    engine_gpus: int = 0
    """GPUs per engine (its tensor-parallel size); 0 on CPU."""
    engine_cpus: float = 1.0
    colocate: bool = False
    """true: learner rank i shares engine i's bundle (GPUs time-shared between rollout and training).
    false: disaggregated, the learner has bundles of its own."""


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"
    """offline, online or disabled."""
    project: str = "april-ray"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


_CHOICES = {
    "task.name": ("countdown", "math"),
    "task.length.family": ("lognormal", "pareto", "exponential", "uniform"),
    "engine.backend": ("cpu", "sglang"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "rollout.stale_policy": ("restart", "keep"),
    "placement.strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "algorithm.name": ("grpo", "dapo", "gspo"),
    "algorithm.loss_aggregation": ("token_mean", "seq_mean_token_mean"),
    "learner.backend": ("deepspeed", "torch"),
    "learner.zero_stage": (0, 1, 2, 3),
}
_POSITIVE = (
    "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.head_dim",
    "model.intermediate_size", "model.max_position_embeddings", "warmup.batch_size", "warmup.lr",
    "warmup.num_threads", "task.num_train", "task.num_eval", "task.length.median", "task.length.sigma",
    "task.length.alpha", "task.length.min_terms", "task.max_step", "engine.max_num_seqs", "engine.max_model_len",
    "engine.max_prefill_tokens", "engine.num_threads", "rollout.rollout_batch_size",
    "rollout.over_sampling_batch_size", "rollout.n_samples_per_prompt", "rollout.max_response_len",
    "rollout.top_p", "rollout.num_engines", "rollout.abort_resend_s", "placement.engine_cpus",
    "learner.num_ranks", "learner.lr", "learner.micro_batch_tokens", "learner.num_threads", "train.num_steps",
    "train.eval_every", "train.save_every",
)


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> Config:
    for key, allowed in _CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be > 0, got {_get(cfg, key)}")
    if cfg.warmup.steps < 0:
        raise ConfigError(f"warmup.steps: must be >= 0, got {cfg.warmup.steps}")
    if cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ConfigError("model.num_heads: must be a multiple of model.num_kv_heads")
    if cfg.task.length.max_terms < cfg.task.length.min_terms:
        raise ConfigError("task.length.max_terms: must be >= task.length.min_terms")
    if cfg.task.name == "math" and not cfg.task.train_path:
        raise ConfigError("task.train_path: the math task needs a dataset file")
    if not cfg.model.path and cfg.engine.max_model_len > cfg.model.max_position_embeddings:
        raise ConfigError("engine.max_model_len: exceeds model.max_position_embeddings")
    if cfg.placement.engine_gpus < 0:
        raise ConfigError("placement.engine_gpus: must be >= 0")
    for key in ("engine.park_slots", "engine.kv_reuse_max_staleness"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {_get(cfg, key)}")
    if cfg.learner.backend == "torch" and cfg.learner.num_ranks != 1:
        raise ConfigError("learner.num_ranks: the torch backend trains on one rank; use learner.backend=deepspeed")
    if cfg.placement.colocate and cfg.learner.num_ranks > cfg.rollout.num_engines:
        raise ConfigError("learner.num_ranks: colocation puts each rank in an engine's bundle; "
                          "needs learner.num_ranks <= rollout.num_engines")
    a = cfg.algorithm
    if a.clip_low < 0 or a.clip_high < 0 or a.kl_coef < 0 or a.tis_cap < 0 or a.overlong_buffer < 0:
        raise ConfigError("algorithm.clip_low, clip_high, kl_coef, tis_cap, overlong_buffer: must be >= 0")
    r = cfg.rollout
    if r.over_sampling_batch_size < r.rollout_batch_size:
        raise ConfigError(f"rollout.over_sampling_batch_size: must be >= rollout.rollout_batch_size "
                          f"({r.over_sampling_batch_size} < {r.rollout_batch_size})")
    if r.temperature < 0 or r.top_p > 1 or r.max_staleness < 0:
        raise ConfigError("rollout.temperature, rollout.max_staleness: must be >= 0; rollout.top_p: <= 1")
    if r.max_response_len >= cfg.engine.max_model_len:
        raise ConfigError(f"rollout.max_response_len: {r.max_response_len} leaves no room for the prompt "
                          f"in engine.max_model_len {cfg.engine.max_model_len}")
    return cfg


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Schema, then the YAML file at `path`, then `key=value` overrides; then `validate`."""
    try:
        merged = OmegaConf.structured(Config)
        if path:
            if not Path(path).is_file():
                raise ConfigError(f"config file not found: {path}")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        where = f" (in {path} or overrides)" if path else ""
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}{where}" if key else f"{msg}{where}") from None
    return validate(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file under configs/")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. engine.max_num_seqs=64")


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        raise SystemExit(0)
    return cfg
