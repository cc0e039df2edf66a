"""One typed config tree: a dataclass per component, nested under `Config`.

Loading is OmegaConf's structured merge (schema, then a YAML file, then `key=value` overrides), so an
unknown key or a wrong type fails at start with the key's full name. `validate()` then checks each
field's value rule (declared next to the field: `positive`, `one_of`, ...) and the rules that relate two
keys, and raises `ConfigError` naming the key. Each actor gets only its own section, and
nothing writes to the tree after validation.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from april_ray.errors import ConfigError  # noqa: F401  (raised here, imported from here by callers)
from april_ray.schedule import SCHEDULES


def default_cache_dir() -> str:
    return os.environ.get("APRIL_RAY_CACHE", str(Path.home() / ".cache" / "april_ray"))


def _rule(default, text: str, check) -> Any:
    """A field whose value rule sits next to it: `validate` checks `check(value)` and names the key."""
    return field(default=default, metadata={"rule": (text, check)})


def positive(default):
    return _rule(default, "> 0", lambda v: v > 0)


def non_negative(default):
    return _rule(default, ">= 0", lambda v: v >= 0)


def one_of(default, *choices):
    return _rule(default, "one of " + ", ".join(map(str, choices)), lambda v: v in choices)


def _is_band(v) -> bool:
    """Two numbers, low <= 1 <= high, low >= 0 (a band without 1 would mask on-policy tokens; NaN fails)."""
    return len(v) == 2 and all(isinstance(x, (int, float)) for x in v) and 0 <= v[0] <= 1 <= v[1]


def probability(default):
    return _rule(default, "in (0, 1]", lambda v: 0 < v <= 1)


def gpu_count(default):
    """Whole GPUs, or a share of one below 1 (bundles that share a device: Ray's fractional GPUs)."""
    return _rule(default, "an integer >= 0, or a fraction in (0, 1)",
                 lambda v: (isinstance(v, int) and v >= 0) or 0 < v < 1)


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face directory of the policy. Empty: build (or reuse) the embedded tiny model in cache_dir."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Where the embedded model and task data are built and cached ($APRIL_RAY_CACHE overrides)."""
    hidden_size: int = positive(128)
    """Embedded model only (ignored with `path`): width of the residual stream."""
    num_layers: int = positive(4)
    num_heads: int = positive(4)
    num_kv_heads: int = positive(2)
    """Grouped-query attention: num_heads must be a multiple of it."""
    head_dim: int = positive(32)
    intermediate_size: int = positive(384)
    max_position_embeddings: int = positive(1024)


@dataclass
class WarmupConfig:
    """Supervised warm-up that turns a random tiny model into a policy worth RL-training."""

    steps: int = non_negative(800)
    batch_size: int = positive(32)
    lr: float = positive(3e-3)
    num_threads: int = positive(2)
    seed: int = 0


@dataclass
class LengthConfig:
    """Distribution of the number of countdown terms; a response is about 5 tokens per term."""

    family: str = one_of("lognormal", "lognormal", "pareto", "exponential", "uniform")
    """lognormal (median, sigma), pareto (median as scale x_m, alpha), exponential (median), uniform."""
    median: float = positive(6.0)
    sigma: float = positive(1.0)
    alpha: float = positive(1.2)
    min_terms: int = positive(1)
    max_terms: int = positive(100)
    """At least min_terms."""


@dataclass
class TaskConfig:
    name: str = "countdown"
    """A task of april_ray/task/registry.py. countdown: the embedded synthetic task. math: answers checked with
    math-verify (needs train_path). lookup_countdown: the embedded agent task, countdowns from values a tool
    looks up (april_ray/task/lookup_countdown.py; its episode function is rollout.episode_fn)."""
    train_path: str = ""
    """JSONL or Parquet with prompt and answer fields. Empty: generate the countdown task in cache_dir."""
    eval_path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    num_train: int = positive(20000)
    num_eval: int = positive(256)
    seed: int = 1234
    """Seed of the generated task and of the prompt order (shuffled per epoch)."""
    max_step: int = positive(3)
    """Countdown steps are drawn from 1..max_step; larger steps make the arithmetic harder."""
    length: LengthConfig = field(default_factory=LengthConfig)
    overlong_prompts: str = one_of("fail", "fail", "skip")
    """Prompts (train and eval) longer than engine.max_model_len - sampling.max_response_len tokens. fail
    (the default: checked when the job starts, so it costs seconds, and a silently smaller dataset would
    change what the run trains on and what held-out accuracy means): stop, naming the file and line.
    skip: drop them, warning with their count and first lines."""
    reward_timeout_s: float = positive(30.0)
    """A reward call running longer gets reward 0 and counts in rollout/reward_errors (as does one that
    raises); the job goes on. It runs in a thread, so the engine's event loop never waits for it."""
    reward_fn: str = ""
    """`module:function` replacing the task's reward: `(prompt, response, answer, metadata) -> float`, sync or
    async, imported once per engine worker (its directory on PYTHONPATH). `metadata` is the dataset row's
    other fields. Empty: the task's own reward (countdown or math)."""
    reward_per_group: bool = False
    """task.reward_fn is a group function, `(prompts, responses, answers, metadatas) -> list[float]` (one reward
    per response, same order; sync or async), called once per group when its last sample finishes, before
    the dynamic filter and the advantages (april_ray/rollout/engine_worker.py). It fails as a group: if it
    raises, times out or returns anything but one number per response, every sample scores 0 and each one
    counts in rollout/reward_errors. Held-out evaluation calls it with groups of one. Needs reward_fn."""
    reward_url: str = ""
    """A served reward model instead: each finished sample is POSTed as JSON {prompt, response, answer,
    metadata}, and the reply is a number or {"reward": number}. Exclusive with reward_fn."""
    reward_url_timeout_s: float = positive(10.0)
    """Per request to reward_url; a request that times out, fails to connect or gets a 5xx is retried."""
    reward_url_retries: int = non_negative(2)
    """Retries after the first request (then the sample scores 0, counted as a reward error)."""
    reward_after_think: bool = False
    """The task's own reward (countdown, math) scores only the text after the last `</think>`; a response
    without one scores 0 (a reasoning model cut off mid-thought gave no answer)."""
    apply_chat_template: str = _rule("auto", "auto, true or false",
                                     lambda v: str(v).lower() in ("auto", "true", "false"))
    """auto: prompts go through the tokenizer's chat template when it has one; true: they must (an error if
    it has none); false: prompt text is encoded as is (a chat row's user turns joined by newlines). With the
    template a prompt's ids are exactly `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    **chat_template_kwargs)`; a string prompt is one user message, a list of messages keeps its system turns."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Passed to the chat template, e.g. {enable_thinking: false} for Qwen3."""
    metadata_keys: list[str] | None = None
    """The row's fields (besides prompt and answer) that become the samples' metadata; null: all of them. A
    sample carries its metadata through Ray, the store and checkpoints, so leave out long ones (DeepMath's
    r1_solution_*)."""


@dataclass
class EngineConfig:
    backend: str = one_of("cpu", "cpu", "cpu_http", "sglang")
    """cpu: our continuous-batching engine inside each engine actor. cpu_http: our engine in a server of its
    own (april_ray/engine/http_server.py) spoken to over SGLang's HTTP API, on CPU: the GPU path's client,
    aborts, pauses, keys and weight channels on a laptop. Both run on the GPU an engine is placed with
    (placement.engine_gpus), if any. sglang: `sglang.launch_server` on the actor's GPUs
    (the `sglang` extra). The last two are the server backends."""
    num_engines: int = positive(2)
    """Engine actors (each one an inference server with its own batch). With min_engines, the target."""
    min_engines: int | None = None
    """An elastic fleet (preemptible nodes): the job runs while at least this many engines are placed, takes
    back each missing one, caught up to the current weights, once Ray places it again, and waits (saying so)
    below it. Each engine gets a placement group of its own, so it can land on any node with room. Between 1
    and num_engines; None: every engine, placed together with the learner (a fixed fleet)."""
    max_num_seqs: int = positive(64)
    """Concurrency cap: sequences in the running batch (and KV-cache slots)."""
    max_model_len: int = positive(640)
    """Prompt plus response tokens per sequence (KV-cache length); above sampling.max_response_len."""
    max_prefill_tokens: int = positive(8192)
    """Prompt tokens admitted per step; bounds a step's latency (and so abort latency)."""
    num_threads: int = positive(1)
    """torch intra-op threads per engine."""
    seed: int = 0
    park_slots: int = non_negative(0)
    """cpu: spare KV-cache slots that keep aborted sequences' caches, so a resumed sample skips its
    re-prefill (oldest evicted first). 0: every resume re-runs its prefix."""
    reuse_stale_kv: bool = False
    """cpu: a resumed sample may reuse a parked cache that weights up to staleness.max_versions old
    computed (PipelineRL-style; its new tokens' behaviour logprobs are still exactly what sampled them,
    so truncated IS corrects for the stale context). false: only caches of the current weights.
    sglang: a weight update keeps the server's prefix cache (no flush_cache); false flushes it."""
    host: str = "127.0.0.1"
    """server backends: the address servers bind to. Learners on other nodes need an address they reach
    (this node's, or 0.0.0.0 on a trusted network); every server needs a key either way (random, per server;
    README, Security)."""
    tp_size: int = positive(1)
    """server backends: tensor-parallel size of each SGLang server (= placement.engine_gpus)."""
    mem_fraction: float = probability(0.8)
    """sglang backend: SGLang's --mem-fraction-static (weights plus KV cache, share of GPU memory)."""
    startup_timeout_s: float = positive(600.0)
    """server backends: how long a server may take to answer /health before the job fails with its log."""
    weight_sync: str = one_of("object_store", "object_store", "broadcast", "tensor", "disk")
    """How new weights reach the engines. object_store: rank 0 puts them once, each engine actor loads them
    (into its server by shared memory). broadcast: rank 0 broadcasts into every server (NCCL; gloo with
    engine.backend=cpu_http), disaggregated. tensor: each rank hands them by handle to the server on its own GPU
    (CUDA IPC), colocated; the servers release memory while the learner trains. disk: a safetensors
    directory under train.output_dir that every server loads."""
    weight_bucket_mb: float = positive(512.0)
    """broadcast and tensor: weights go in buckets of about this size."""

    @property
    def elastic(self) -> bool:
        """Engines come and go (min_engines below num_engines): each is placed on its own."""
        return self.min_engines is not None and self.min_engines < self.num_engines

    @property
    def broadcast_backend(self) -> str:
        """The weight broadcast's torch.distributed backend: gloo into our CPU server, NCCL into SGLang's."""
        return "gloo" if self.backend == "cpu_http" else "nccl"

    @property
    def releases_memory(self) -> bool:
        """Colocated servers give their GPU memory back while the learner trains (the tensor channel)."""
        return self.weight_sync == "tensor"


@dataclass
class SamplingConfig:
    """How responses are sampled, in rollout and in evaluation at temperature 1."""

    temperature: float = _rule(1.0, "0 or a finite number >= 1e-6", lambda v: v == 0 or 1e-6 <= v < float("inf"))
    """0 means greedy. The learner scores tokens under the same temperature (below 1e-6 logits / temperature
    overflows float32; SGLang samples such temperatures greedily)."""
    top_p: float = probability(1.0)
    top_k: int = _rule(-1, "-1 or >= 1", lambda v: v == -1 or v >= 1)
    """-1 disables."""
    max_response_len: int = positive(512)
    """Response budget per sample, summed over all its resumes (below engine.max_model_len)."""


@dataclass
class RolloutConfig:
    """The completion monitor's knobs. One group = n_samples_per_prompt samples of one prompt."""

    rollout_batch_size: int = positive(16)
    """N: complete groups per step (what the learner trains on)."""
    over_sampling_batch_size: int | str = _rule(32, "an integer >= rollout_batch_size, or auto",
                                                lambda v: v == "auto" or (isinstance(v, int) and v > 0))
    """N': groups kept in flight until N are complete (april and oversample; sync uses N). At least N.
    auto (april only): chosen at every step from how full the engines' slots were and how much of the batch
    was masked as stale (april_ray/rollout/over_sampling.py), within [N, over_sampling_max_factor x N]."""
    over_sampling_max_factor: float = _rule(4.0, ">= 1", lambda v: v >= 1)
    """auto: the largest N'/N it may choose."""
    n_samples_per_prompt: int = positive(8)
    schedule: str = one_of("april", *SCHEDULES)
    """april: over-provision N' groups, interrupt once N are complete, recycle the unfinished ones next step.
    sync: the synchronous baseline, N groups in flight, nothing interrupted. oversample: slime's rollout
    without partial rollout (the APRIL paper's baseline): N' groups start the step, and once N are complete
    the unfinished ones are aborted and discarded with their tokens (their prompts are not retried), as
    are complete groups beyond N; no top-up but for the dynamic filter (one fresh group per one its drops
    leave missing from N). Every schedule keeps everything in the store when a step fails."""
    dynamic_filter: bool = False
    """DAPO dynamic sampling: drop complete groups whose rewards all agree, and refill their slots."""
    max_filtered_groups: int = positive(256)
    """A step fails (with every sample kept in the store) once the filter has dropped more groups than this."""
    abort_resend_s: float = positive(2.0)
    """Re-send the abort if requests are still outstanding after this long (aborts are idempotent)."""
    engine_wait_s: float = positive(600.0)
    """With every engine dead mid-step, wait this long for one to be restarted and handed back (with the
    current weights) before the step fails, its samples stored."""
    episode_fn: str = _rule("", "empty or module:function", lambda v: not v or v.count(":") == 1)
    """Multi-turn episodes: an async function `module:function` that drives each sample through its turns
    (april_ray/rollout/episode.py); it must be importable on every node. Empty: one engine call per sample."""
    tool_timeout_s: float = positive(60.0)
    """An episode's tool call (`ep.call_tool`, async or plain) running longer raises in the episode (one
    that lets it through fails: its group is dropped, not trained)."""
    episode_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments every call of `episode_fn` gets after the handle (an environment's settings)."""
    agent_fn: str = _rule("", "empty or module:function", lambda v: not v or v.count(":") == 1)
    """Any agent, unchanged: `async def agent(base_url, api_key, row, **agent_kwargs) -> float | None`, run
    per sample against an OpenAI-compatible endpoint of its engine (april_ray/rollout/agent_endpoint.py).
    Set either this or episode_fn."""
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments every call of `agent_fn` gets after (base_url, api_key, row)."""
    agent_park_s: float = positive(600.0)
    """An agent whose open request an abort cut waits this long for its sample to be resumed on its engine;
    past it the agent is cancelled, and the sample's next run starts it again (served its recorded turns)."""
    max_turns: int = non_negative(0)
    """An episode's model turns at most: a `generate` past the last one returns "" with finish reason
    LENGTH. 0: no limit."""
    max_env_tokens_per_turn: int = non_negative(0)
    """Environment tokens one `append_env` may add; longer ones are cut to this (the last tokens dropped).
    0: no limit."""


def over_sampling_batch_size(factor: float, rollout_batch_size: int) -> int:
    """N' for an over-provisioning factor N'/N (never below N)."""
    return max(rollout_batch_size, round(factor * rollout_batch_size))


def within_versions(age, max_versions: int):
    """The one staleness rule: what policy version v computed (a token, a parked KV cache) is within a bound
    of `max_versions` while the policy is at most v + max_versions. `age` is an int, or a tensor of ages."""
    return age <= max_versions


@dataclass
class StalenessConfig:
    """The one bound on how old (in policy versions) the tokens of a partial sample may get. The store, the
    learner's loss mask and the engines' parked KV caches ask it (`restarts`, `trains`, `kv_max_versions`)."""

    max_versions: int = non_negative(4)
    """A token sampled by policy version v is stale once the policy being trained is past v + max_versions."""
    policy: str = one_of("mask", "keep", "restart", "mask")
    """mask (the default): stale tokens are kept, and the learner masks them out of the loss, wherever they
    waited (partial in the store, or a finished member of a group that waited for its siblings, or a
    surplus group). restart: the store also restarts a partial sample whose oldest token is stale from its
    prompt (its tokens counted as discarded), and the learner masks what still went stale (finished
    members and surplus groups are never restarted). keep: nothing is enforced; every token is trained,
    corrected by truncated IS only. mask is the default because it bounds every trained token at the cost
    of the few masked ones, while restart throws whole samples away and can restart a response longer
    than the bound's worth of steps forever (docs/architecture.md, "The life of a sample")."""

    def trains(self, age):
        """Whether the learner trains a token sampled `age` versions ago (`keep` trains every token); for a
        tensor of ages, a tensor of booleans (or True under `keep`)."""
        return self.policy == "keep" or within_versions(age, self.max_versions)

    def restarts(self, age: int) -> bool:
        """Whether the store restarts a partial sample from its prompt, its oldest token `age` versions old
        when it would resume."""
        return self.policy == "restart" and not within_versions(age, self.max_versions)

    def kv_max_versions(self, reuse_stale_kv: bool) -> int:
        """How many versions old a parked KV cache may be and still be reused (engine.reuse_stale_kv); 0:
        only a cache of the current weights."""
        return self.max_versions if reuse_stale_kv else 0

    def oldest_trained(self, hist: dict[int, int]) -> int:
        """Age in versions of the oldest token the learner trains, from a batch's tokens by age
        (`rollout/staleness_hist`)."""
        return max((age for age, n in hist.items() if n and self.trains(age)), default=0)


@dataclass
class AlgorithmConfig:
    name: str = one_of("grpo", "grpo", "dapo", "gspo")
    """Presets below are GRPO's; configs/ sets DAPO's and GSPO's published values."""
    clip_low: float = non_negative(0.2)
    clip_high: float = non_negative(0.2)
    """DAPO's clip-higher uses 0.28; GSPO clips the sequence ratio at about 3e-4 / 4e-4."""
    loss_aggregation: str = one_of("seq_mean_token_mean", "token_mean", "seq_mean_token_mean")
    """token_mean (DAPO) or seq_mean_token_mean (GRPO as published); GSPO averages over sequences."""
    normalize_adv_std: bool = True
    kl_coef: float = non_negative(0.0)
    """Weight of k3 KL to the reference model (the warm-up policy); 0 loads no reference model."""
    tis_cap: float = non_negative(2.0)
    """Truncated importance sampling's cap (corrections tis and seq_mask_tis): per-token weight
    min(pi_old / pi_behaviour, tis_cap); 0: weight 1."""
    correction: str = one_of("tis", "tis", "icepop", "seq_mask_tis", "none")
    """How the behaviour policy's tokens weigh in the loss, by r = pi_old / pi_behaviour per token
    (april_ray/learn/corrections.py): tis, min(r, tis_cap); icepop, r inside correction_band and 0 outside;
    seq_mask_tis, 0 for every token of a sequence whose geometric mean of r is outside correction_band and
    min(r, tis_cap) inside; none, 1. A token weighted 0 still counts in the loss's mean."""
    correction_band: list[float] = field(default_factory=lambda: [0.5, 2.0],
                                         metadata={"rule": ("[low, high] with 0 <= low <= 1 <= high", _is_band)})
    """[low, high] of r (icepop) or of a sequence's geometric mean of r (seq_mask_tis). One band for both,
    as OpenRLHF and NeMo-RL have: symmetric in log space (|log r| <= log 2), its top tis_cap's default, so tis,
    icepop and seq_mask_tis differ only in what they do outside one trust region. A geometric mean averages
    a sequence's noise away: seq_mask_tis at this band masks only a sequence whose mean log r passes log 2."""
    overlong_buffer: int = non_negative(0)
    """DAPO overlong shaping: penalise the last this-many tokens of the budget linearly down to -1; 0 disables."""


@dataclass
class LearnerConfig:
    backend: str = one_of("deepspeed", "deepspeed", "torch")
    """deepspeed (ZeRO; gloo on CPU, NCCL/RCCL on GPU) or torch (plain AdamW, one rank)."""
    num_ranks: int = positive(1)
    """Data-parallel world size: one learner actor per rank."""
    zero_stage: int = one_of(1, 0, 1, 2, 3)
    lr: float = positive(2e-4)
    weight_decay: float = non_negative(0.0)
    grad_clip: float = positive(1.0)
    micro_batch_tokens: int = positive(16384)
    """Padded tokens per forward/backward micro-batch."""
    max_spread: float = _rule(2.0, ">= 1", lambda v: v >= 1)
    """A micro-batch's longest sample is at most this many times its shortest (bounds the padding, as the
    engine's prefill chunks do); a large value packs micro-batches by the token budget alone."""
    num_minibatches: int = positive(1)
    """Optimiser steps per rollout batch (PPO mini-batches, samples shuffled). Above 1, the step starts with
    one no-grad forward for the proximal policy's logprobs, which the clipped ratio is taken against."""
    num_threads: int = positive(2)
    gpus: int | float = gpu_count(0)
    """GPUs per learner rank; a fraction below 1 shares one (placement.engine_gpus)."""
    cpus: float = non_negative(1.0)
    dtype: str = one_of("auto", "auto", "float32", "bfloat16")
    """Weights and activations: bfloat16 keeps fp32 master weights and optimiser states (DeepSpeed's bf16
    section; torch autocast with the torch backend); the loss's log-probs are fp32 either way. auto: bfloat16
    on a GPU, float32 on CPU (where bf16 matmuls are slower and the tiny model needs no memory saving)."""
    gradient_checkpointing: bool = False
    """Keep only each layer's input in the forward and recompute the layer in backward (about 1/3 more
    compute for activations that no longer grow with the number of layers x their width)."""
    logprob_chunk_tokens: int = non_negative(1024)
    """The vocabulary head and log-softmax run on this many tokens at a time, recomputed in backward, so no
    [tokens x vocab] tensor is whole (0: the whole micro-batch at once)."""
    attn_implementation: str = one_of("sdpa", "sdpa", "eager", "flash_attention_2")
    """Attention kernel of the learner's model (flash_attention_2 needs the flash-attn package and a GPU)."""
    packing: str = one_of("auto", "auto", "on", "off")
    """on: a micro-batch is its samples back to back in one row, positions restarting per sample, no
    padding (micro_batch_tokens then counts real tokens). off: right-padded rows, their spread bounded by
    max_spread (faster on CPU). auto: on with flash_attention_2 on a GPU (its varlen kernel keeps the
    samples apart), off otherwise."""
    gpu_memory_gb: float = positive(80.0)
    """Memory of one learner GPU for the memory plan (`python -m jobs.plan`) when it runs where no GPU is
    visible; a job on GPUs checks against the device's own."""


@dataclass
class TrainConfig:
    num_steps: int = positive(60)
    eval_every: int = positive(10)
    save_every: int = positive(20)
    max_restores: int = non_negative(8)
    """How many times the job restores itself in place to its newest checkpoint when an actor other than an
    engine dies (a learner rank, the completion monitor, the store, the prompt source: driver/restore.py);
    one more such death stops it, naming the command that resumes it (a crash loop ends there). 0: the
    first one stops it."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir (policy, optimizer, cursor, store, version). false: a
    new run; an earlier run's files in output_dir are moved to output_dir/runs/<its run id> first."""
    start_over: bool = False
    """With resume: when every checkpoint the run saved is unusable, or another run's checkpoints are in
    output_dir, start a new run from step 0 (the files moved aside as for a fresh run) instead of stopping
    with what was rejected and why."""
    output_dir: str = "outputs/train"
    eval_greedy: bool = True
    """Also evaluate greedily (temperature 0) on the held-out prompts."""
    overlap: bool = False
    """The overlapped mode: the engines never stop. The next batch's rollout runs while the learner trains on
    this one, its unfinished groups go on generating across steps, and new weights reach the engines in
    flight (a sample's tokens may span versions; each keeps its own). Needs rollout.schedule=april, engines
    apart from the learner (placement.colocate=false) and staleness.max_versions >= 1. The step before each
    checkpoint and the last step drain the rollout as a synchronous step does."""
    overlap_ahead: int = positive(1)
    """With train.overlap: how many batches the engines may run ahead of the learner (the steps asked for
    before the learner's batch is waited for). At most staleness.max_versions (unless staleness.policy=keep):
    a batch asked k steps ahead is trained k versions after its first tokens were sampled."""
    seed: int = 0
    """The run's seed: offsets the learner's (mini-batch order, torch) and the prompt order's seeds; the task's
    data stays task.seed's and the engines sample with engine.seed (jobs.bench.train sets both per seed)."""


RUN_SEED_STRIDE = 7919
"""How far one train.seed moves a seed `run_seeded` derives (a prime)."""


def run_seeded(base: int, run_seed: int) -> int:
    """`base` (a component's own seed: the prompt order's task.seed, the learner's torch seed) offset by the
    run's train.seed; train.seed 0 keeps `base`. Changing the formula changes what every run draws (and so
    every figure measured with a seed)."""
    return base + RUN_SEED_STRIDE * run_seed


@dataclass
class EvalSetConfig:
    """One named evaluation set, read as training data is (JSONL or Parquet, errors naming the row)."""

    path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"


@dataclass
class EvalConfig:
    """Evaluation sets beyond the held-out split: each scored with the task's reward every
    train.eval_every steps, into eval/<name>/pass@1, eval/<name>/pass@k (k = 2, 4, ... up to
    n_samples_per_prompt; the unbiased estimator of the Codex paper), eval/<name>/reward_mean and
    eval/<name>/response_len. The held-out split (task.eval_path) keeps eval/accuracy_t1 and
    eval/accuracy_greedy: one sample per prompt, at temperature 1 and greedily."""

    datasets: dict[str, EvalSetConfig] = field(default_factory=dict)
    """name -> {path, prompt_key, answer_key}, e.g. aime: {path: /data/aime-2024.parquet}."""
    n_samples_per_prompt: int = positive(1)
    """Responses per prompt (APRIL reports AIME with 16)."""
    temperature: float = _rule(1.0, "0 or a finite number >= 1e-6", lambda v: v == 0 or 1e-6 <= v < float("inf"))
    """0 means greedy."""
    top_p: float = probability(1.0)
    pass_reward: float = 1.0
    """A response passes (for pass@k) when its reward is at least this."""


@dataclass
class PlacementConfig:
    """How actors map onto the cluster: one placement group, a bundle per engine (and learner rank)."""

    strategy: str = one_of("PACK", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
    """Ray placement-group strategy."""
    engine_gpus: int | float = gpu_count(0)
    """GPUs per engine (its tensor-parallel size); 0 on CPU. A fraction below 1 shares one GPU with other
    bundles: placement.engine_gpus=0.5 learner.gpus=0.5 puts a disaggregated engine and learner on one device.
    Our engine (engine.backend cpu or cpu_http) runs on the GPU it is placed with."""
    engine_cpus: float = positive(1.0)
    engine_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each engine bundle asks for besides CPUs and GPUs, e.g. {spot: 1} so that engines
    land only on the (preemptible) nodes started with `ray start --resources='{"spot": 8}'`."""
    colocate: bool = False
    """true: learner rank i shares engine i's bundle (GPUs time-shared between rollout and training).
    false: disaggregated, the learner has bundles of its own."""


@dataclass
class LoggingConfig:
    wandb_mode: str = one_of("offline", "offline", "online", "disabled")
    project: str = "april-ray"
    tensorboard: bool = False
    """Also write metrics.jsonl's values as TensorBoard scalars, by step, under `train.output_dir`/tensorboard."""
    dashboard: bool = True
    """A local run (no RAY_ADDRESS) starts Ray's dashboard on 127.0.0.1; a joined cluster keeps its own."""
    dashboard_port: int = non_negative(0)
    """The local dashboard's port; 0: Ray's default, 8265 or the next free one after it."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _check_fields(obj, prefix: str) -> None:
    for f in fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            _check_fields(value, key + ".")
        elif "rule" in f.metadata:
            text, check = f.metadata["rule"]
            if not check(value):
                raise ConfigError(f"{key}: must be {text}, got {value!r}")


def _check_across(cfg: Config) -> None:
    """Rules that relate two keys; each error names the key to change."""
    _check_task(cfg)
    _check_engines(cfg)
    _check_learner_and_rollout(cfg)
    _check_overlap(cfg)
    _check_algorithm(cfg.algorithm)


def _check_algorithm(algo: AlgorithmConfig) -> None:
    if algo.name == "gspo" and algo.correction == "icepop":
        raise ConfigError("algorithm.correction: icepop masks single tokens, and GSPO weighs a sequence by the "
                          "geometric mean of its tokens' weights (one masked token would scale it by 1e-8 to the "
                          "power 1/length); with algorithm.name=gspo use seq_mask_tis, tis or none")


def _check_overlap(cfg: Config) -> None:
    """What the overlapped mode needs: the learner's GPUs apart from the engines', the APRIL schedule, and
    room in the staleness bound for the tokens sampled before an update that lands mid-sample."""
    if not cfg.train.overlap:
        if cfg.train.overlap_ahead != 1:
            raise ConfigError(f"train.overlap_ahead: {cfg.train.overlap_ahead} steps ahead needs the overlapped "
                              f"mode (train.overlap=true); without it the rollout never runs ahead")
        return
    if cfg.placement.colocate:
        raise ConfigError("train.overlap: a colocated layout (placement.colocate=true) trains on the engines' "
                          "devices, so the two cannot run at once; set placement.colocate=false or train.overlap=false")
    if not SCHEDULES[cfg.rollout.schedule].keeps_running:
        raise ConfigError(f"train.overlap: keeps APRIL's unfinished groups running across steps; needs "
                          f"rollout.schedule=april, got {cfg.rollout.schedule}")
    if cfg.staleness.max_versions < 1 and cfg.staleness.policy != "keep":
        raise ConfigError("staleness.max_versions: the overlapped mode (train.overlap=true) trains tokens sampled "
                          "one version before the learner's; needs staleness.max_versions >= 1")
    if cfg.train.overlap_ahead > cfg.staleness.max_versions and cfg.staleness.policy != "keep":
        raise ConfigError(f"train.overlap_ahead: {cfg.train.overlap_ahead} steps ahead trains tokens that many "
                          f"versions old, past staleness.max_versions={cfg.staleness.max_versions}; lower it or "
                          f"raise staleness.max_versions")


def _check_task(cfg: Config) -> None:
    """The model, the task, its rewards and the evaluation sets."""
    if cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ConfigError("model.num_heads: must be a multiple of model.num_kv_heads")
    if cfg.task.length.max_terms < cfg.task.length.min_terms:
        raise ConfigError("task.length.max_terms: must be >= task.length.min_terms")
    if cfg.task.reward_fn and cfg.task.reward_url:
        raise ConfigError("task.reward_url: set either task.reward_fn or task.reward_url, not both")
    if cfg.task.reward_url and not cfg.task.reward_url.startswith(("http://", "https://")):
        raise ConfigError(f"task.reward_url: expected an http:// or https:// URL, got {cfg.task.reward_url!r}")
    if cfg.task.reward_per_group and cfg.task.reward_url:
        raise ConfigError("task.reward_per_group: task.reward_url scores one sample at a time; "
                          "a group function comes by task.reward_fn")
    if cfg.task.reward_per_group and not cfg.task.reward_fn:
        raise ConfigError("task.reward_per_group: needs task.reward_fn, the group function "
                          "(prompts, responses, answers, metadatas) -> list[float]")
    if cfg.task.reward_fn and ":" not in cfg.task.reward_fn:
        raise ConfigError(f"task.reward_fn: expected module:function, got {cfg.task.reward_fn!r}")
    if cfg.rollout.agent_fn and cfg.rollout.episode_fn:
        raise ConfigError(f"rollout.agent_fn: set either it or rollout.episode_fn ({cfg.rollout.episode_fn!r}), "
                          "not both in one place (one given on the command line replaces the other from the YAML)")
    for name, dataset in cfg.eval.datasets.items():
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"eval.datasets.{name}: a name of letters, digits, - and _ (it names the metrics)")
        if not dataset.path:
            raise ConfigError(f"eval.datasets.{name}.path: required (a JSONL or Parquet file)")
    try:  # a name of april_ray/task/registry.py (imported here: the engines import config.py, never a task)
        from april_ray.task.registry import get_task
        get_task(cfg.task.name).check(cfg.task)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_engines(cfg: Config) -> None:
    """The engines' context, backend, weight channel and placement."""
    if not cfg.model.path and cfg.engine.max_model_len > cfg.model.max_position_embeddings:
        raise ConfigError("engine.max_model_len: exceeds model.max_position_embeddings")
    e, p = cfg.engine, cfg.placement
    if e.backend == "cpu" and e.weight_sync != "object_store":
        raise ConfigError(f"engine.weight_sync: {e.weight_sync} sends weights to inference servers; the cpu backend "
                          "has none (use object_store, or a server backend: engine.backend=cpu_http or sglang)")
    if e.backend == "sglang" and p.engine_gpus != e.tp_size:
        raise ConfigError(f"placement.engine_gpus: an SGLang server runs on engine.tp_size={e.tp_size} GPUs, "
                          f"got {p.engine_gpus}")
    if e.backend != "cpu" and e.tp_size > 1 and e.weight_sync in ("tensor", "object_store"):
        raise ConfigError(f"engine.weight_sync: {e.weight_sync} hands one payload to a server of one tensor-parallel "
                          f"rank; servers of engine.tp_size={e.tp_size} take broadcast or disk")
    if e.weight_sync == "tensor" and not (p.colocate and cfg.learner.num_ranks == e.num_engines):
        raise ConfigError("engine.weight_sync: tensor hands weights to the server on the rank's own device; "
                          "needs placement.colocate=true and learner.num_ranks == engine.num_engines")
    if e.weight_sync == "broadcast" and p.colocate and p.engine_gpus:
        raise ConfigError("engine.weight_sync: broadcast (NCCL) cannot join a learner and a server on one GPU; "
                          "colocated layouts use tensor")
    if e.min_engines is not None and not 1 <= e.min_engines <= e.num_engines:
        raise ConfigError(f"engine.min_engines: must be between 1 and engine.num_engines ({e.num_engines}), "
                          f"got {e.min_engines}")
    if e.elastic and p.colocate:
        raise ConfigError("engine.min_engines: an elastic fleet places each engine on its own; colocated engines "
                          "share their bundles with learner ranks (placement.colocate=false, or no min_engines)")
    if cfg.sampling.max_response_len >= cfg.engine.max_model_len:
        raise ConfigError(f"sampling.max_response_len: {cfg.sampling.max_response_len} leaves no room for the "
                          f"prompt in engine.max_model_len {cfg.engine.max_model_len}")


def _check_learner_and_rollout(cfg: Config) -> None:
    """The learner ranks against the batch and the engines, and N' against N."""
    if cfg.learner.backend == "torch" and cfg.learner.num_ranks != 1:
        raise ConfigError("learner.num_ranks: the torch backend trains on one rank; use learner.backend=deepspeed")
    if cfg.learner.num_ranks > cfg.rollout.rollout_batch_size:
        raise ConfigError(f"learner.num_ranks: each rank trains on whole groups; needs learner.num_ranks <= "
                          f"rollout.rollout_batch_size ({cfg.learner.num_ranks} > {cfg.rollout.rollout_batch_size})")
    if cfg.placement.colocate and cfg.learner.num_ranks > cfg.engine.num_engines:
        raise ConfigError("learner.num_ranks: colocation puts each rank in an engine's bundle; "
                          "needs learner.num_ranks <= engine.num_engines")
    r = cfg.rollout
    error = SCHEDULES[r.schedule].config_error(r)
    if error:
        raise ConfigError(error)
    if r.over_sampling_batch_size != "auto" and r.over_sampling_batch_size < r.rollout_batch_size:
        raise ConfigError(f"rollout.over_sampling_batch_size: must be >= rollout.rollout_batch_size "
                          f"({r.over_sampling_batch_size} < {r.rollout_batch_size})")


def with_rollout(cfg: Config, **changes) -> Config:
    """`cfg` with its rollout section changed, validated (benchmarks compare schedules on one config)."""
    return validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **changes)))


def validate(cfg: Config) -> Config:
    _check_fields(cfg, "")
    _check_across(cfg)
    return cfg


RETIRED = {"rollout.partial_rollout": "rollout.schedule (april | sync | oversample)",
           "rollout.discard_unfinished": "rollout.schedule=oversample",
           "rollout.over_sampling": "rollout.over_sampling_batch_size (an integer N', or auto)",
           "engine.server": "engine.backend (cpu | cpu_http | sglang; engine.server=cpu is engine.backend=cpu_http)"}
"""Keys that no longer exist -> what replaced them."""


def _check_retired(keys) -> None:
    for key in keys:
        if key in RETIRED:
            raise ConfigError(f"{key}: no longer a key; use {RETIRED[key]}")


def _dotted_keys(tree, prefix: str = ""):
    for k, v in (tree.items() if isinstance(tree, dict) else ()):
        yield f"{prefix}{k}"
        yield from _dotted_keys(v, f"{prefix}{k}.")


def _load_yaml(path: str):
    """The YAML file at `path` as a mapping of sections; a ConfigError names the file (and the line)."""
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, engine:, ...), "
                          f"got a {type(OmegaConf.to_container(loaded)).__name__}")
    return loaded


def load_structured(schema, path: str | None = None, overrides: list[str] | tuple[str, ...] = ()):
    """Schema (the dataclass `schema`), then the YAML file at `path`, then `key=value` overrides; then each
    field's value rule. An error is a ConfigError naming the key (the job's config and the simulator's)."""
    try:
        merged = OmegaConf.structured(schema)
        if path:
            if not Path(path).is_file():
                raise ConfigError(f"config file not found: {path}")
            loaded = _load_yaml(path)
            _check_retired(_dotted_keys(OmegaConf.to_container(loaded)))
            merged = OmegaConf.merge(merged, loaded)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value")
        _check_retired(item.split("=", 1)[0].lstrip("+") for item in overrides)
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        where = f" (in {path} or overrides)" if path else ""
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}{where}" if key else f"{msg}{where}") from None
    _check_fields(cfg, "")
    return cfg


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """`load_structured` on `Config`, then the rules that relate two keys (the two together: `validate`)."""
    cfg = load_structured(Config, path, overrides)
    _one_way_to_run_a_sample(cfg.rollout, overrides)
    _check_across(cfg)
    return cfg


def _one_way_to_run_a_sample(rollout: RolloutConfig, overrides) -> None:
    """A command-line `rollout.agent_fn` replaces the YAML's `rollout.episode_fn`, and the other way round
    (`--config configs/tiny_agent_cpu.yaml rollout.agent_fn=...` runs the agent); both given in one place stay
    an error (`_check_task`)."""
    given = {o.split("=", 1)[0].strip().lstrip("+~") for o in overrides}
    if rollout.agent_fn and rollout.episode_fn:
        if "rollout.agent_fn" in given and "rollout.episode_fn" not in given:
            rollout.episode_fn = ""
        elif "rollout.episode_fn" in given and "rollout.agent_fn" not in given:
            rollout.agent_fn = ""


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
