"""The simulator's own config section, `simulate.*` (`python -m jobs.simulate ... simulate.key=value`).

Its defaults describe the GPU setting of `configs/qwen3_4b_dapo.yaml`; every one is an assumption the
simulator states in its output (`assumptions` in its JSON). The rest of the setting (model, batch,
over-provisioning, budget, engines, staleness) is read from the job's own config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from april_ray.config import ConfigError, load_config, load_structured, non_negative, one_of, positive, probability
from sim.workload import load_lengths_file


@dataclass
class SimulateConfig:
    accelerator: str = one_of("h100", "h100", "h200", "mi300x")
    """Accelerator of every engine and learner GPU (sim/hardware.py: datasheet numbers)."""
    bandwidth_efficiency: float = probability(0.8)
    """Share of peak memory bandwidth a decode step achieves (assumption: serving engines reach ~70-85%)."""
    flops_efficiency: float = probability(0.5)
    """Share of peak bf16 FLOP/s in prefill and in a decode step's arithmetic (assumption)."""
    step_overhead_s: float = non_negative(0.0015)
    """t0 of a decode step: scheduling, launches, sampling (assumption: ~1.5 ms with CUDA graphs)."""
    learner_mfu: float = probability(0.35)
    """Learner time = tokens x 6 x params / (GPUs x peak FLOP/s x this) (assumption)."""
    weight_sync_gb_s: float = positive(50.0)
    """Bandwidth of the weight broadcast after each step, GB/s (assumption: one 400 Gb/s NIC)."""
    length_family: str = one_of("lognormal", "lognormal", "pareto", "histogram", "task")
    """Response lengths: lognormal (length_median, length_sigma), pareto (length_median as the scale x_m,
    length_alpha), histogram or task (length_file)."""
    length_median: float = positive(3000.0)
    """Median response in tokens (assumption for Qwen3-4B reasoning traces on DAPO-Math)."""
    length_sigma: float = positive(1.0)
    """Log-space spread: with median 3,000, ~4.5% of samples reach a 16,384 budget (assumption)."""
    length_alpha: float = positive(1.2)
    """pareto: the tail index (the countdown task's default, task.length.alpha)."""
    length_file: str = ""
    """JSON of measured lengths (sim/workload.py: load_lengths_file)."""
    group_correlation: float = non_negative(0.5)
    """Correlation of the normal scores of one prompt's samples' lengths, at most 1 (assumption; 1: all
    alike, 0: independent)."""
    prompt_len: int = positive(256)
    """Prompt tokens, chat template included (assumption for DAPO-Math prompts)."""
    num_prompts: int = positive(17398)
    """Dataset rows (DAPO-Math-17k); prompts are drawn in the prompt source's shuffled order."""
    filtered_fraction: float = non_negative(0.0)
    """Share of prompts whose samples all get the same reward (dropped by a dynamic filter); 0: none."""
    token_block: int = non_negative(0)
    """Tokens simulated as one: 0 picks the largest power of two that leaves >= 512 of the budget."""
    steps: int = positive(20)
    """Measured RL steps per schedule."""
    warmup_steps: int = non_negative(3)
    """Steps run first and not measured (APRIL's store fills in the first few)."""
    seed: int = 0


@dataclass
class _SimulateRoot:
    """The tree `simulate.*` overrides are merged into, so errors name their key with its prefix."""

    simulate: SimulateConfig = field(default_factory=SimulateConfig)


def load_simulate_config(overrides: list[str]) -> SimulateConfig:
    """`simulate.key=value` items (the prefix included) over the defaults, loaded as the job's config is
    (`load_structured`: each value checked by its rule, errors naming the key), then the rules across keys."""
    cfg = load_structured(_SimulateRoot, None, overrides).simulate
    if cfg.group_correlation > 1:
        raise ConfigError(f"simulate.group_correlation: must be <= 1, got {cfg.group_correlation}")
    if cfg.length_family in ("histogram", "task") and not cfg.length_file:
        raise ConfigError(f"simulate.length_file: length_family={cfg.length_family} needs a lengths file")
    return cfg


def study_inputs(parser, args) -> tuple:
    """The job's config and its `simulate.*` section from `args.config` and `args.overrides`, the lengths
    file read once, and `args.gpus` parsed: anything bad stops the job with a message naming it."""
    try:
        cfg = load_config(args.config, [o for o in args.overrides if not o.startswith("simulate.")])
        sim = load_simulate_config([o for o in args.overrides if o.startswith("simulate.")])
    except ConfigError as e:
        parser.error(str(e))
    if sim.length_file:
        try:
            load_lengths_file(sim.length_file)
        except ValueError as e:
            parser.error(f"simulate.length_file: {e}")
    tp = max(1, cfg.placement.engine_gpus)
    args.gpus = number_list(parser, "--gpus", args.gpus, int, lambda g: g >= tp and g % tp == 0,
                            f"multiples of placement.engine_gpus={tp} (GPUs per engine)")
    return cfg, sim


def number_list(parser, flag: str, text: str, kind, ok, rule: str) -> list:
    """A comma-separated list of numbers, each checked; a bad one stops the job with a message naming it."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text}: expected comma-separated {kind.__name__} values ({rule})")
    bad = [v for v in values if not ok(v)]
    if bad:
        parser.error(f"{flag}: {', '.join(map(str, bad))}: expected {rule}")
    return values
