"""Chaos with nodes (`python -m jobs.chaos --node-churn`): the training job on an elastic fleet over a real
multi-raylet cluster on this machine, while worker nodes leave and join.

    python -m jobs.chaos --config configs/tiny_cpu.yaml --node-churn --json PATH [key=value ...]

A head node (the driver, the learner, the monitor, the store) and two worker nodes, each with room for two
engines (the custom resource `engine_node`, which only engine bundles ask for: placement.engine_resources),
under `ray.cluster_utils.Cluster`; three engines, engine.min_engines=1. Over one run:

1. after step `PREEMPT_AT`, the worker holding the most engines is preempted gracefully: SIGTERM to its
   engine processes (a spot instance's notice, a Kubernetes drain), `GRACE_S` for them to hand back their
   partial samples, then the node removed. Its engines are placed again where there is room.
2. after step `JOIN_AT`, a new worker node joins: the engines waiting for room are placed there, caught up
   to the current weights and taken in by the next step.
3. after step `KILL_AT`, the other original worker is lost: its raylet SIGKILLed (`remove_node(...,
   allow_graceful=False)`), its engines with it, their in-flight samples re-dispatched as after a crash.

The result: the checks of `groups.jsonl` (driver/records.py: 0 lost, 0 trained twice, the staleness bound
held), each event with the steps it covers, and per step the live engines, the seconds and throughput, the
GCS's share of a core, the leaves and crashes the monitor saw and the tokens crashes lost (0 over the
graceful leave's steps: `graceful`); and the throughput by live engines (`by_live_engines`).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

from driver.records import check_records
from jobs.chaos_driver import read_jsonl

NODE_CHURN_DEFAULTS = ["engine.num_engines=3", "engine.min_engines=1", "placement.engine_resources.engine_node=1",
                       "placement.engine_cpus=0.5", "learner.cpus=2", "train.save_every=10", "task.num_eval=64"]
"""Three engines that land on worker nodes only, the job running while one is live; the learner's bundle
(2 CPUs) fits only the head (a worker has 1 CPU: two engines' halves)."""
ENGINES_PER_WORKER = 2
PREEMPT_AT, JOIN_AT, KILL_AT = 5, 11, 16
"""Steps finished before each event: none falls on an evaluation (after steps 10, 20, 30)."""
GRACE_S = 5.0
"""Between the SIGTERM and the node's removal (Kubernetes gives 30 s by default; the drain takes < 1 s)."""
ENGINE_TITLE = "ray::EngineWorkerActor"
"""The process title Ray gives an engine actor's process."""


class NodeChurn:
    """The node events of a run on `cluster`, each once `groups.jsonl` in `out_dir` has enough step rows. It
    runs on the main thread (the job on another): Ray's `Node` sets a SIGTERM handler when it starts."""

    def __init__(self, cluster, workers: list, out_dir: Path):
        self.cluster, self.workers, self.out_dir = cluster, list(workers), out_dir
        self.events: list[dict] = []
        self.stop = threading.Event()
        self.error: str | None = None
        self.gcs_cpu: dict[int, tuple[float, float]] = {}
        """Steps done -> (time, the GCS process's CPU seconds) when they were first seen done."""

    def steps_done(self) -> int:
        path = self.out_dir / "groups.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.is_file() else []
        return sum(1 for line in lines if line.strip() and "end" not in json.loads(line))

    def run(self) -> None:
        """Each event once its step is done, and the GCS's CPU time at each step's end, until the job ends."""
        import psutil

        gcs = psutil.Process(self.cluster.head_node.all_processes["gcs_server"][0].process.pid)
        events = [(PREEMPT_AT, self.preempt), (JOIN_AT, self.join), (KILL_AT, self.kill)]
        try:
            while not self.stop.wait(0.2):
                done = self.steps_done()
                self.gcs_cpu.setdefault(done, (time.time(), sum(gcs.cpu_times()[:2])))
                if events and done >= events[0][0]:
                    at, event = events.pop(0)
                    self.events.append({"after_step": at, "t": time.time(), **event()})
                    print(f"chaos: {json.dumps(self.events[-1])}", flush=True)
        except Exception as e:  # reported in the result: an event that did not happen must not pass unseen
            self.error = f"{type(e).__name__}: {e}"

    def gcs_share(self, step: int) -> float | None:
        """The share of one core the GCS used while `step` ran (Ray's placement retries showed there)."""
        (t0, c0), (t1, c1) = self.gcs_cpu.get(step, (0, 0)), self.gcs_cpu.get(step + 1, (0, 0))
        return round((c1 - c0) / (t1 - t0), 2) if t0 and t1 > t0 else None

    @staticmethod
    def engines_on(node) -> list[int]:
        """The engine processes the raylet of `node` started (its worker processes are its children)."""
        import psutil

        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        return sorted(p.pid for p in raylet.children(recursive=True)
                      if " ".join(p.cmdline()).startswith(ENGINE_TITLE))

    def preempt(self) -> dict:
        node = max(self.workers, key=lambda n: len(self.engines_on(n)))
        pids = self.engines_on(node)
        if not pids:
            raise RuntimeError("no worker node holds an engine to preempt")
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(GRACE_S)
        self.cluster.remove_node(node)
        self.workers.remove(node)
        return {"event": "preempt", "node": node.node_id, "engine_pids": pids}

    def join(self) -> dict:
        node = add_worker(self.cluster)
        self.workers.append(node)
        return {"event": "join", "node": node.node_id}

    def kill(self) -> dict:
        node = self.workers[0]  # the original worker left
        pids = self.engines_on(node)
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)
        return {"event": "kill", "node": node.node_id, "engine_pids": pids}


def start_cluster():
    """Head (the learner's 2 CPUs, no engine room) and two workers with room for two engines each; this
    process joins it."""
    import ray
    from ray.cluster_utils import Cluster

    # a raylet waits 15 s for its dashboard agent, then exits: a Python process a loaded 2-core machine may
    # take longer to start
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    cluster = Cluster()
    with_retries(lambda: cluster.add_node(num_cpus=2, include_dashboard=False))
    workers = [add_worker(cluster) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, workers


def add_worker(cluster):
    return with_retries(lambda: cluster.add_node(num_cpus=1, resources={"engine_node": ENGINES_PER_WORKER}))


def with_retries(start, attempts: int = 3):
    """`start()` (a node of the cluster), again when its raylet took longer to register than Ray waits (a
    fixed 30 s, which a loaded 2-core machine exceeds), after ending the processes the failed try left."""
    import psutil

    for attempt in range(attempts):
        before = {p.pid for p in psutil.Process().children()}
        try:
            return start()
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise
            for node_process in (p for p in psutil.Process().children() if p.pid not in before):
                with contextlib.suppress(psutil.NoSuchProcess):
                    for p in [*node_process.children(recursive=True), node_process]:  # the raylet's agents too
                        p.kill()
            print(f"chaos: a node's raylet did not register within Ray's 30 s; starting it again", flush=True)


def run_node_churn(cfg) -> dict:
    """The job on a churning cluster, then its records checked (see the module's docstring)."""
    import ray

    from driver.train import train

    out = Path(cfg.train.output_dir)
    for name in ("groups.jsonl", "metrics.jsonl"):
        (out / name).unlink(missing_ok=True)
    cluster, workers = start_cluster()
    churn, outcome, t0 = NodeChurn(cluster, workers, out), {}, time.time()

    def job() -> None:
        try:
            outcome["summary"] = train(cfg)
        except Exception as e:  # the check still runs: how far did it get, and was anything lost?
            outcome["error"] = f"{type(e).__name__}: {e}"
        finally:
            churn.stop.set()

    running = threading.Thread(target=job, daemon=True)
    running.start()
    try:
        churn.run()
        running.join()
    finally:
        ray.shutdown()
        cluster.shutdown()
    error, summary = outcome.get("error"), outcome.get("summary", {})
    result = {"steps": cfg.train.num_steps, "overlap": cfg.train.overlap, "num_engines": cfg.engine.num_engines,
              "min_engines": cfg.engine.min_engines, "staleness_bound": cfg.staleness.max_versions,
              "wall_s": round(time.time() - t0, 1), "accuracy_before": summary.get("accuracy_before"),
              "accuracy_after": summary.get("accuracy_after"), "error": error, "churn_error": churn.error}
    result |= check_records(out, cfg.rollout.n_samples_per_prompt)
    per_step = [r | {"gcs_cpu_share": churn.gcs_share(r["step"])} for r in step_rows(out)]
    result["events"] = with_windows(churn.events, per_step, cfg.train.num_steps)
    result["per_step"] = per_step
    result["by_live_engines"] = by_live_engines(per_step)
    graceful = next((e for e in result["events"] if e["event"] == "preempt"), None)
    result["graceful"] = graceful and {k: graceful[k] for k in ("crash_tokens_lost", "engine_crashes", "engine_leaves")}
    result["ok"] = (error is None and churn.error is None and len(churn.events) == 3
                    and result["steps_completed"] == result["steps"] and not result["lost_samples"]
                    and not result["duplicated_samples"] and cfg.staleness.trains(result["max_trained_staleness"])
                    and graceful["crash_tokens_lost"] == 0 and graceful["engine_crashes"] == 0
                    and graceful["engine_leaves"] > 0)
    return result


def step_rows(out: Path) -> list[dict]:
    """Per step: the live engines at its end, its seconds (rollout, learner and weight sync; the evaluation
    after it apart), its throughput (samples trained and tokens generated per step second, tokens per rollout
    second), and the leaves, crashes and crash-lost tokens the monitor saw in it."""
    keys = {"engines_live": "engines/live", "samples": "train/num_samples", "generated_tok_s": "rollout/generated_tok_s",
            "effective_tok_s": "rollout/effective_tok_s", "engine_leaves": "rollout/engine_leaves",
            "engine_crashes": "rollout/engine_crashes", "crash_tokens_lost": "rollout/crash_tokens_lost",
            "generated_tokens": "rollout/generated_tokens"}
    rows = []
    for r in read_jsonl(out / "metrics.jsonl"):
        if "engines/live" not in r:  # the final evaluation's row
            continue
        step_s = sum(r.get(f"time/{phase}_s", 0.0) for phase in ("rollout", "learner", "weight_sync"))
        row = {"step": int(r["step"]), **{k: r.get(v) for k, v in keys.items()}, "step_s": round(step_s, 2),
               "eval_s": round(r.get("time/eval_s", 0.0), 2)}
        row["samples_per_s"] = round(row["samples"] / step_s, 2) if step_s and row["samples"] else None
        row["tok_per_step_s"] = round(row["generated_tokens"] / step_s, 1) if step_s else None
        rows.append(row)
    return rows


def by_live_engines(rows: list[dict]) -> list[dict]:
    """Per number of live engines at a step's end: the steps, their median seconds and samples per second."""
    out = []
    for live in sorted({r["engines_live"] for r in rows}):
        steps = [r for r in rows if r["engines_live"] == live]
        out.append({"engines_live": live, "steps": [r["step"] for r in steps],
                    "step_s_median": statistics.median(r["step_s"] for r in steps),
                    "samples_per_s_median": statistics.median(r["samples_per_s"] or 0 for r in steps)})
    return out


def with_windows(events: list[dict], rows: list[dict], num_steps: int) -> list[dict]:
    """Each event with the steps from it to the next one, and the leaves, crashes and crash-lost tokens of
    those steps."""
    out = []
    for i, e in enumerate(events):
        until = events[i + 1]["after_step"] if i + 1 < len(events) else num_steps
        window = [r for r in rows if e["after_step"] <= r["step"] < until]
        out.append(e | {"steps": [e["after_step"], until - 1],
                        **{k: sum(r[k] or 0 for r in window) for k in ("engine_leaves", "engine_crashes",
                                                                         "crash_tokens_lost")},
                        "engines_live": [r["engines_live"] for r in window]})
    return out
