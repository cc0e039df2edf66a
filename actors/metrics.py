"""The job's metrics in Ray's metrics system (`ray.util.metrics`): every name, kind and tag is in `METRICS`.

Each metric is recorded by the process that owns what it measures, once per step and never per token:
an engine actor (occupancy, idle share, tokens/s, token counters, policy version) when the driver drains
its statistics after a rollout, the store actor (its partial groups, its oldest sample) when asked for
its statistics, the monitor actor (abort latency, off-policy ratio, staleness of the trained batch, engine
crashes) after each rollout, and the driver's `MetricsActor` (step phase times, reward, held-out accuracy,
steps, and the learner's train-inference mismatch by token age): a worker process of the cluster exports at
its node's interval, which a driver started from any shell need not share. Every Ray node serves them on its
metrics export port with Ray's `ray_` prefix (`ray_april_engine_occupancy`, ...);
cluster/grafana/april_dashboard.json charts them (cluster/README.md). `mode` is `april` or `sync`; `age` is a
token's age in policy versions (`all`: every age).

Ray's metrics agent drops a gauge value that was not set again within two export intervals
(`RAY_metrics_report_interval_ms`), and a process exports only the values set since its last export: a
value set once a step (minutes, on GPUs) would be on the endpoint for seconds. So every gauge here is
held: `Held` sets its last values again every half export interval for as long as its process lives.
What happens each step is also counted (steps, phase seconds, tokens; histograms where the distribution
matters), so Prometheus rebuilds every step from the counters' increases, whatever it missed in between.
Counters exist at 0 from the start: the first increment is an increase, and "no crash" reads 0.
"""
from __future__ import annotations

import threading
import time

import ray
from ray.util.metrics import Counter, Gauge, Histogram

ABORT_LATENCY_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# Ray's boundaries must be positive: the bucket le=k+0.5 holds the tokens k policy versions old.
STALENESS_VERSIONS = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 16.5, 32.5]
# Observations a step of the staleness histogram: the ages' shares of the batch's tokens, in percent. One
# Ray observe costs 3-18 us (idle vs loaded 2-core machine), so never one per token; in thousandths it
# cost ~18 ms a step in the monitor actor under load, in percent ~2 ms.
STALENESS_OBSERVATIONS = 100

METRICS = {  # name: (kind, tag keys, description)
    "april_engine_occupancy": (Gauge, ("engine",), "Running rows / max_num_seqs, mean over the engine steps of the last rollout"),
    "april_engine_bubble_fraction": (Gauge, ("engine",), "Idle share of the engine's last rollout, from its first call of the step to its last result"),
    "april_engine_tokens_per_s": (Gauge, ("engine",), "Tokens generated per second of the engine's last rollout"),
    "april_engine_weight_version": (Gauge, ("engine",), "Policy version of the weights the engine samples with"),
    "april_engine_prefill_tokens_total": (Counter, ("engine",), "Prompt and resumed tokens prefilled"),
    "april_engine_reused_kv_tokens_total": (Counter, ("engine",), "Prefill tokens skipped: a resumed sample found its parked KV cache"),
    "april_engine_generated_tokens_total": (Counter, ("engine",), "Tokens sampled"),
    "april_engine_crashes_total": (Counter, ("engine",), "Engine deaths the monitor saw (their samples were re-dispatched)"),
    "april_engine_leaves_total": (Counter, ("engine",), "Engines the monitor saw leave gracefully (preempted or drained: their samples came back with every token), or not placed at the start"),
    "april_live_engines": (Gauge, (), "Engines taking work (engine.num_engines is the target; an elastic fleet runs with fewer while nodes are missing)"),
    "april_abort_latency_seconds": (Histogram, ("mode",), "From the N-th completed group to every engine call resolved, per step"),
    "april_store_partial_groups": (Gauge, (), "Groups with interrupted samples waiting in the partial-rollout store"),
    "april_store_oldest_age_versions": (Gauge, (), "Policy versions behind the current one, of the oldest token in the store"),
    "april_rollout_off_policy_token_ratio": (Gauge, ("mode",), "Share of the last trained batch's tokens sampled by an older policy"),
    "april_trained_token_staleness_versions": (Histogram, ("mode",), "Trained tokens by age in policy versions: 100 observations a step, each age observed in proportion to its share of the batch's tokens"),
    "april_rollout_trained_tokens_total": (Counter, ("mode",), "Tokens of the trained batches"),
    "april_rollout_off_policy_tokens_total": (Counter, ("mode",), "Trained tokens sampled by an older policy"),
    "april_step_phase_seconds": (Gauge, ("phase",), "Seconds of the last step in each phase: rollout, learner, weight_sync, eval"),
    "april_step_phase_seconds_total": (Counter, ("phase",), "Seconds in each phase over the steps: its increase over a window, divided by april_steps_total's, is the mean step"),
    "april_reward_mean": (Gauge, ("mode",), "Mean reward of the last trained batch"),
    "april_eval_accuracy": (Gauge, ("kind",), "Held-out accuracy of the last evaluation: t1 (temperature 1) or greedy"),
    "april_idle_fraction": (Gauge, ("role",), "Idle share of the job's wall time so far: engines (1 - busy seconds / engines x wall) or learner (1 - training and weight-sending seconds / wall)"),
    "april_step": (Gauge, (), "Training steps completed (the step index: a resumed job goes on from its checkpoint)"),
    "april_steps_total": (Counter, (), "Training steps completed by this job since it started"),
    "april_mismatch_log_ratio": (Gauge, ("age",), "Mean log(pi_learner / pi_rollout) over the last trained batch's tokens, by age in policy versions (all: every age)"),
    "april_mismatch_kl": (Gauge, ("age", "estimator"), "KL(pi_rollout || pi_learner) of the last trained batch's tokens by age, estimated by k1, k2 and k3"),
    "april_mismatch_correction_share": (Gauge, ("age", "correction"), "Share of the last batch's trained tokens that each correction (tis, icepop, seq_mask_tis) masks or clips, by age"),
    "april_mismatch_tokens_total": (Counter, ("age",), "Tokens of the trained batches by age in policy versions (the mismatch metrics' counts)"),
}
BOUNDARIES = {"april_abort_latency_seconds": ABORT_LATENCY_S,
              "april_trained_token_staleness_versions": STALENESS_VERSIONS}


def metric(name: str, zeros: tuple[dict, ...] = ()):
    """The Ray metric `name` of `METRICS` (each process that records it makes its own); a gauge is `Held`,
    and a counter starts at 0 for each tag set of `zeros`."""
    kind, tag_keys, description = METRICS[name]
    if kind is Histogram:
        return Histogram(name, description, boundaries=BOUNDARIES[name], tag_keys=tag_keys)
    if kind is Gauge:
        return Held(Gauge(name, description, tag_keys=tag_keys))
    counter = Counter(name, description, tag_keys=tag_keys)
    for tags in zeros:
        counter._record(0.0, tags=tags)  # what `inc` records, without its refusal of 0
    return counter


def export_interval_s() -> float:
    """How often this process exports its metrics: Ray's `metrics_report_interval_ms`, which its emitter
    raises to 1 s at least (as ray/_private/telemetry/open_telemetry_metric_recorder.py says)."""
    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000


class Held:
    """A gauge whose last value for each tag set is set again every half export interval, from a daemon
    thread shared by the process's held gauges, so that every export carries it."""

    _lock = threading.Lock()
    _values: dict[tuple, tuple] = {}  # (held gauge, tags) -> (gauge, value, tags): the process's last values
    _thread: threading.Thread | None = None

    def __init__(self, gauge: Gauge):
        self.gauge = gauge

    def forget(self, **match) -> None:
        """Stops setting again this gauge's values whose tags include `match` (Ray's agent then drops them)."""
        with Held._lock:
            for key in [k for k in Held._values if k[0] is self and match.items() <= dict(k[1]).items()]:
                del Held._values[key]

    def set(self, value: float, tags: dict | None = None) -> None:
        self.gauge.set(value, tags=tags)
        with Held._lock:
            Held._values[(self, tuple(sorted((tags or {}).items())))] = (self.gauge, value, tags)
            if Held._thread is None:
                Held._thread = threading.Thread(target=Held._keep, args=(export_interval_s() / 2,), daemon=True,
                                                name="april-held-gauges")
                Held._thread.start()

    @staticmethod
    def _keep(period_s: float) -> None:
        while True:
            time.sleep(period_s)
            with Held._lock:
                values = list(Held._values.values())
            for gauge, value, tags in values:
                gauge.set(value, tags=tags)


class EngineMetrics:
    """An engine actor's metrics. Its window for the step opens at the step's first call and ends with its
    last result; `record` closes it when the driver drains the engine's statistics after the rollout."""

    def __init__(self, engine: int, capacity: int):
        self.tags = {"engine": str(engine)}
        self.capacity = capacity
        self.gauges = {k: metric(f"april_engine_{k}") for k in ("occupancy", "bubble_fraction", "tokens_per_s",
                                                                 "weight_version")}
        self.counters = {k: metric(f"april_engine_{k}_tokens_total", zeros=(self.tags,))
                         for k in ("prefill", "reused_kv", "generated")}
        self.counted = {k: 0 for k in self.counters}
        self.window: list[float] | None = None  # [start, end, engine busy_s at start, tokens at start]

    def call_started(self, engine_stats) -> None:
        """`engine_stats(drain=False)` is read only by the step's first call, which opens the window."""
        if self.window is None:
            now, stats = time.perf_counter(), engine_stats(drain=False)
            self.window = [now, now, stats.busy_s, stats.num_generated_tokens]

    def call_ended(self) -> None:
        if self.window is not None:
            self.window[1] = time.perf_counter()

    def set_version(self, version: int) -> None:
        self.gauges["weight_version"].set(version, tags=self.tags)

    def record(self, stats) -> None:
        """At each drain of the engine's statistics (`april_ray.types.EngineStats`): the counters, and the
        gauges of the rollout when one ran since the last drain (the driver drains after each rollout;
        the evaluator drains after an evaluation, which no rollout gauge describes)."""
        if self.window is not None:
            occ = [n / self.capacity for _, n in stats.occupancy]
            self.gauges["occupancy"].set(sum(occ) / len(occ) if occ else 0.0, tags=self.tags)
            start, end, busy0, tokens0 = self.window
            wall = max(end - start, 1e-9)
            self.gauges["bubble_fraction"].set(min(1.0, max(0.0, 1 - (stats.busy_s - busy0) / wall)), tags=self.tags)
            self.gauges["tokens_per_s"].set((stats.num_generated_tokens - tokens0) / wall, tags=self.tags)
            self.window = None
        totals = {"prefill": stats.num_prefill_tokens, "reused_kv": stats.num_reused_tokens,
                  "generated": stats.num_generated_tokens}
        for key, total in totals.items():
            if total > self.counted[key]:
                self.counters[key].inc(total - self.counted[key], tags=self.tags)
            self.counted[key] = total
        self.set_version(stats.version)


class StoreMetrics:
    """The partial-rollout store actor's, from its `stats(version)`."""

    def __init__(self):
        self.partial_groups = metric("april_store_partial_groups")
        self.oldest_age = metric("april_store_oldest_age_versions")

    def record(self, stats: dict) -> None:
        self.partial_groups.set(stats["store/groups"])
        self.oldest_age.set(stats["store/max_age"])


def shares(hist: dict[int, int], units: int = STALENESS_OBSERVATIONS) -> dict[int, int]:
    """Each key's share of the counts in `units`, rounded by largest remainder: they sum to `units`."""
    total = sum(hist.values())
    if total <= 0:
        return {}
    exact = {k: units * n / total for k, n in hist.items() if n > 0}
    out = {k: int(x) for k, x in exact.items()}
    short = units - sum(out.values())
    for k in sorted(exact, key=lambda k: out[k] - exact[k])[:short]:
        out[k] += 1
    return {k: n for k, n in out.items() if n}


class MonitorMetrics:
    """The completion monitor actor's, from a step's result and the engines it still has."""

    def __init__(self, rollout, num_engines: int):
        self.mode = {"mode": rollout.schedule}
        self.aborts = self.mode["mode"] != "sync"  # the synchronous baseline never aborts
        self.abort_latency = metric("april_abort_latency_seconds")
        self.off_policy = metric("april_rollout_off_policy_token_ratio")
        self.staleness = metric("april_trained_token_staleness_versions")
        self.trained_tokens = metric("april_rollout_trained_tokens_total", zeros=(self.mode,))
        self.off_policy_tokens = metric("april_rollout_off_policy_tokens_total", zeros=(self.mode,))
        engines = tuple({"engine": str(e)} for e in range(num_engines))
        self.crashes = metric("april_engine_crashes_total", zeros=engines)
        self.leaves = metric("april_engine_leaves_total", zeros=engines)
        self.live = metric("april_live_engines")
        self.alive = [True] * num_engines

    def record(self, metrics: dict, staleness: dict[int, int], engines) -> None:
        if self.aborts and not metrics.get("rollout/groups_running"):  # an overlapped step that kept running: none
            self.abort_latency.observe(metrics["rollout/abort_latency_s"], tags=self.mode)
        ratio, trained = metrics["rollout/off_policy_token_ratio"], metrics["rollout/trained_tokens"]
        self.off_policy.set(ratio, tags=self.mode)
        if trained > 0:
            self.trained_tokens.inc(trained, tags=self.mode)
        if round(ratio * trained) > 0:
            self.off_policy_tokens.inc(round(ratio * trained), tags=self.mode)
        # a fixed number of observations a step, not one per token: the same shape at any batch size
        for age, n in shares(staleness).items():
            for _ in range(n):
                self.staleness.observe(age, tags=self.mode)
        self.engines_seen(engines)

    def engines_seen(self, engines) -> None:
        """Counts a crash (or a graceful leave) of each engine seen gone that was last seen alive, and sets
        the live count (`engines`: the monitor's `EngineLiveness`). The actor looks at the end of each step
        and whenever the driver asks which engines are alive (it does before it hands a restarted engine
        back), so a crash is seen even when the engine is back within the step."""
        for engine, (was, now, left) in enumerate(zip(self.alive, engines.alive, engines.left)):
            if was and not now:
                (self.leaves if left else self.crashes).inc(1, tags={"engine": str(engine)})
        self.alive = list(engines.alive)
        self.live.set(sum(self.alive))


def mismatch_by_age(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """Age label -> {field: value} from a step row's `mismatch/age{a}/{field}` keys (the learner's
    `MismatchTally`), and "all" from its `mismatch/{field}` ones."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if parts[0] == "mismatch":
            age, name = (parts[1].removeprefix("age"), parts[2]) if len(parts) == 3 else ("all", parts[1])
            rows.setdefault(age, {})[name] = value
    return rows


class StepMetrics:
    """The driver's metrics, in `MetricsActor`: phase times, reward, the train-inference mismatch by token age
    and step after each step, accuracy after each evaluation."""

    PHASES = ("rollout", "learner", "weight_sync", "eval")

    def __init__(self, schedule: str):
        self.mode = {"mode": schedule}
        self.phase = metric("april_step_phase_seconds")
        self.phase_total = metric("april_step_phase_seconds_total", zeros=tuple({"phase": p} for p in self.PHASES))
        self.reward = metric("april_reward_mean")
        self.idle = metric("april_idle_fraction")
        self.accuracy = metric("april_eval_accuracy")
        self.step = metric("april_step")
        self.steps = metric("april_steps_total", zeros=({},))
        self.log_ratio = metric("april_mismatch_log_ratio")
        self.kl = metric("april_mismatch_kl")
        self.correction_share = metric("april_mismatch_correction_share")
        self.mismatch_tokens = metric("april_mismatch_tokens_total", zeros=({"age": "0"},))  # older ages: once seen
        self.ages: set[str] = set()

    def record_step(self, steps_done: int, phases: dict[str, float], metrics: dict[str, float]) -> None:
        """`metrics`: the step's row (its reward, the job's idle shares and its `mismatch/` keys are exported)."""
        for phase in self.PHASES:  # a phase that did not run this step is 0: the stack is the step's time
            self.phase.set(phases.get(phase, 0.0), tags={"phase": phase})
            if phases.get(phase, 0.0) > 0:
                self.phase_total.inc(phases[phase], tags={"phase": phase})
        self.reward.set(metrics["rollout/reward_mean"], tags=self.mode)
        for role in ("engine", "learner"):
            self.idle.set(metrics[f"job/{role}_idle_fraction"], tags={"role": role})
        self.record_mismatch(mismatch_by_age(metrics))
        self.step.set(steps_done)
        self.steps.inc(1)

    def record_mismatch(self, rows: dict[str, dict[str, float]]) -> None:
        """This step's ages; an age the step's batch no longer has leaves the gauges (it is not held)."""
        for age, row in rows.items():
            self.log_ratio.set(row["log_ratio_mean"], tags={"age": age})
            for estimator in ("k1", "k2", "k3"):
                self.kl.set(row[estimator], tags={"age": age, "estimator": estimator})
            for key, share in row.items():
                if key.endswith("_share"):
                    self.correction_share.set(share, tags={"age": age, "correction": key.removesuffix("_share")})
            if age != "all" and row["num_tokens"] > 0:
                self.mismatch_tokens.inc(row["num_tokens"], tags={"age": age})
        for age in self.ages - set(rows):
            for gauge in (self.log_ratio, self.kl, self.correction_share):
                gauge.forget(age=age)
        self.ages = set(rows)

    def record_eval(self, metrics: dict) -> None:
        for kind in ("t1", "greedy"):
            if f"eval/accuracy_{kind}" in metrics:
                self.accuracy.set(metrics[f"eval/accuracy_{kind}"], tags={"kind": kind})


# Ray restarts it and sends it again the calls its death cut off: its gauges are set again at the next step,
# and its counters start over (a Prometheus `rate` takes a counter's reset in its stride).
MetricsActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(StepMetrics)


class DriverMetrics:
    """What the driver holds: `record_step` and `record_eval` of `StepMetrics`, sent to its `MetricsActor`
    without waiting (calls from one caller run in order)."""

    def __init__(self, rollout):
        self.actor = MetricsActor.remote(rollout.schedule)

    def record_step(self, steps_done: int, phases: dict[str, float], metrics: dict[str, float]) -> None:
        keep = ("rollout/reward_mean", "job/engine_idle_fraction", "job/learner_idle_fraction")
        exported = {k: v for k, v in metrics.items() if k in keep or k.startswith("mismatch/")}
        self.actor.record_step.remote(steps_done, dict(phases), exported)

    def record_eval(self, metrics: dict) -> None:
        self.actor.record_eval.remote({k: v for k, v in metrics.items() if k.startswith("eval/accuracy_")})
