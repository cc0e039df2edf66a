"""The `job` part: the training job itself on this device, `python -m jobs.train` on the embedded default
(configs/tiny_cpu.yaml), each run with a local Ray of its own (`driver.cluster.init_ray`), in two layouts:

- overlapped, first, a few steps: the in-actor engine and the learner in bundles of half a GPU each
  (placement.engine_gpus=0.5 learner.gpus=0.5) on the same device, the object-store channel, train.overlap=true.
- colocated, with the rest of the budget: one engine (our engine's server, engine.backend=cpu_http) and one
  DeepSpeed rank share one bundle and its GPU (placement.colocate=true, half each); weights go by CUDA IPC
  (engine.weight_sync=tensor), and the server gives its memory back while the learner trains. A first leg of
  `first_steps` times a step, and a resumed leg (train.resume=true) takes the steps the rest of the budget
  holds, up to `max_steps` (the CPU job's 200), so that held-out accuracy has the most steps to rise in.

Each run: exit status, steps, wall, steps and tokens per second, held-out accuracy before and after, the job's
own records (`driver.records.check_records`: lost and duplicated samples, the oldest trained token), the tail
of its log when it failed; colocated, the device's memory by process while it ran (device_memory.py).
`--smoke` runs both on CPU with tiny settings: two overlapped steps, one colocated step and one resumed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.gpu_check.common import Deadline
from jobs.gpu_check.device_memory import MemorySampler

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny_cpu.yaml"
COMMON = ("logging.wandb_mode=disabled", "logging.dashboard=false", "engine.num_engines=1", "train.eval_greedy=false")
"""Neither wandb nor Ray's dashboard is on the GPU machine (jobs/gpu_check/bundle.py); one engine on one device;
held-out accuracy at temperature 1 only (the greedy pass would double each evaluation)."""
COLOCATED = ("placement.colocate=true", "engine.backend=cpu_http", "engine.weight_sync=tensor", "learner.num_ranks=1")
OVERLAPPED = ("placement.colocate=false", "train.overlap=true")
MARGIN = 1.25
"""The resumed leg's start and each of its steps are taken to cost this much more than the first leg's."""
TAIL_LINES = 30


@dataclass(frozen=True)
class JobScale:
    first_steps: int
    """The colocated run's first leg, which times a step."""
    max_steps: int
    """The colocated run's steps at most."""
    overlap_steps: int
    overlap_share: float
    """Of the part's budget, the most the overlapped run may take (it runs first; what it leaves is the colocated run's)."""
    colocated: tuple[str, ...]
    overlapped: tuple[str, ...]
    size: tuple[str, ...]
    """Overrides of both runs: the batch, lengths and evaluation set."""


GPU_JOB = JobScale(first_steps=15, max_steps=200, overlap_steps=5, overlap_share=0.35,
                   colocated=("placement.engine_gpus=1", "learner.gpus=1"),
                   overlapped=("placement.engine_gpus=0.5", "learner.gpus=0.5", "task.num_eval=128"),
                   size=("engine.max_num_seqs=128",))  # the CPU job's two engines' slots on one
"""Sized for a call that runs `job_shape` first (docs/gpu.md): the overlapped run's ~45 s outside its steps
(start, evaluations) fit its share with 5 steps, and the colocated run's first leg (~65 s outside its steps,
~1.4 s a step on the H200) fits what is left of a 290 s budget; the accuracy bar was met at 420 s alone."""
SMOKE_JOB = JobScale(first_steps=1, max_steps=2, overlap_steps=2, overlap_share=0.4, colocated=(), overlapped=(),
                     size=("warmup.steps=0", "task.num_train=300", "task.num_eval=16", "rollout.rollout_batch_size=4",
                           "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4",
                           "sampling.max_response_len=24", "engine.max_model_len=64"))
"""The embedded model without its warm-up (built in seconds where APRIL_RAY_CACHE points; the GPU run's
warmed-up one is carried in the bundle), tiny batches and lengths."""


def run(smoke: bool, work: Path, deadline: Deadline, progress) -> dict:
    """Overlapped within its share of the budget, then colocated with all that is left (its steps sized to it);
    what is done so far goes to `progress`."""
    scale = SMOKE_JOB if smoke else GPU_JOB
    share = Deadline(time.time() + deadline.left() * scale.overlap_share)
    result = {"overlapped": overlapped(scale, work / "overlapped", share)}
    progress(result)
    result["colocated"] = colocated(scale, work / "colocated", deadline)
    return result


def colocated(scale: JobScale, out: Path, until: Deadline) -> dict:
    overrides = [*COMMON, *scale.size, *COLOCATED, *scale.colocated, f"train.output_dir={out}"]
    sampler = MemorySampler().start()
    legs = [launch(overrides + steps(scale.first_steps), out, "leg1", until)]
    first = legs[0].get("summary")
    more = 0 if first is None else more_steps(first, until.left(), scale.max_steps)
    if more:
        legs.append(launch(overrides + steps(scale.first_steps + more) + ["train.resume=true"], out, "leg2", until))
    return report("colocated", overrides, legs, out) | {"device_memory": sampler.stop()}


def overlapped(scale: JobScale, out: Path, deadline: Deadline) -> dict:
    overrides = [*COMMON, *scale.size, *OVERLAPPED, *scale.overlapped, f"train.output_dir={out}"]
    return report("overlapped", overrides, [launch(overrides + steps(scale.overlap_steps), out, "run", deadline)], out)


def steps(n: int) -> list[str]:
    """`n` steps, evaluated and saved after the last one only (a resumed leg starts from that checkpoint)."""
    return [f"train.num_steps={n}", f"train.eval_every={n}", f"train.save_every={n}"]


def more_steps(first: dict, left_s: float, max_steps: int) -> int:
    """The steps a resumed leg can take in `left_s`: its start, evaluations and checkpoint cost what the first
    leg's did (its wall outside training), and each step what the first leg's did, both times `MARGIN`."""
    done, step_s = first["steps"], first["train_s"] / max(1, first["steps"])
    fixed_s = first["process_wall_s"] - first["train_s"]
    fits = int((left_s - MARGIN * fixed_s) / (MARGIN * step_s)) if step_s > 0 else max_steps
    return max(0, min(max_steps - done, fits))


def launch(overrides: list[str], out: Path, name: str, deadline: Deadline) -> dict:
    """One `jobs.train` process, its output in `out.parent/<out.name>-<name>.log`, stopped at the deadline (its
    driver's watchdog ends its Ray): exit status, its wall and its summary when it wrote one."""
    log = out.parent / f"{out.name}-{name}.log"
    summary = out.parent / f"{out.name}-{name}.json"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "jobs.train", "--config", CONFIG, *overrides, "--summary", str(summary)]
    t0 = time.time()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"},
                                  stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=max(1.0, deadline.left())).returncode
        except subprocess.TimeoutExpired:
            code = "killed at the part's deadline"
    leg = {"name": name, "exit": code, "wall_s": time.time() - t0}
    if code == 0 and summary.is_file():
        leg["summary"] = json.loads(summary.read_text()) | {"process_wall_s": leg["wall_s"]}
    else:
        leg["error"] = tail(log)
    return leg


def tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:]) if log.is_file() else ""


def report(layout: str, overrides: list[str], legs: list[dict], out: Path) -> dict:
    """One run (its legs together) as the JSON has it."""
    from april_ray.config import load_config
    from driver.records import check_records

    done = [leg["summary"] for leg in legs if "summary" in leg]
    rows = step_rows(out)
    train_s = sum(s["train_s"] for s in done)
    res = {"layout": layout, "overrides": overrides, "exit": next((leg["exit"] for leg in legs if leg["exit"] != 0), 0),
           "legs": [{k: v for k, v in leg.items() if k != "summary"}
                    | {k: leg.get("summary", {}).get(k) for k in ("steps", "train_s", "accuracy_after")}
                    for leg in legs],
           "steps": len(rows), "wall_s": sum(leg["wall_s"] for leg in legs), "train_s": train_s,
           "steps_per_s": len(rows) / train_s if train_s else None,
           "generated_tokens_per_s": total(rows, "rollout/generated_tokens") / train_s if train_s else None,
           "trained_tokens_per_s": total(rows, "rollout/trained_tokens") / train_s if train_s else None,
           "accuracy_before": done[0]["accuracy_before"] if done else None,
           "accuracy_after": done[-1]["accuracy_after"] if done else None,
           "time_s": summed([s["time_s"] for s in done])}
    if done:
        res["accuracy_gain_points"] = 100 * (res["accuracy_after"] - res["accuracy_before"])
    if (out / "groups.jsonl").is_file():
        n_samples = load_config(str(ROOT / CONFIG), overrides).rollout.n_samples_per_prompt
        res["records"] = check_records(out, n_samples)
    errors = [f"{leg['name']} ({leg['exit']}):\n{leg['error']}" for leg in legs if "error" in leg]
    return res | ({"error": "\n".join(errors)} if errors else {})


def step_rows(out: Path) -> list[dict]:
    """The job's rows of trained steps in metrics.jsonl (a resumed leg's follow its first leg's)."""
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in rows if "train/version" in r]


def total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0) for r in rows)


def summed(parts: list[dict]) -> dict:
    """Each key's values added up over `parts` (the legs' seconds by phase)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def lines(res: dict) -> list[str]:
    """The table's lines of this part."""
    out = []
    for name, r in res.items():
        if not isinstance(r, dict) or "layout" not in r:
            continue
        acc = ("" if r["accuracy_before"] is None else
               f", accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}")
        rate = "" if not r["steps_per_s"] else (f", {r['steps_per_s']:.2f} steps/s, "
                                                f"{r['generated_tokens_per_s']:.0f} generated tok/s")
        out.append(f"job {name}: exit {r['exit']}, {r['steps']} steps in {r['wall_s']:.0f} s{rate}{acc}")
        rec = r.get("records")
        if rec:
            out.append(f"  records: {rec['lost_samples']} lost, {rec['duplicated_samples']} duplicated, oldest trained "
                       f"token {rec['max_trained_staleness']} versions old, complete {rec['complete_record']}")
        mem = r.get("device_memory")
        if mem and mem.get("source"):
            server = mem["by_role_mib"].get("engine_server")
            out.append(f"  device memory: {mem['device_used_mib']}" + (f"; engine server {server}" if server else ""))
        if "error" in r:
            out.append("  " + r["error"].splitlines()[-1] if r["error"].strip() else "  (no output)")
    return out
