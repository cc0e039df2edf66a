"""The agent task as an unchanged OpenAI agent beside the episode handle: the same job over several seeds.

    python -m jobs.bench.agent --config configs/tiny_agent_cpu.yaml --seeds 3 --json PATH [--first-seed S]
        [--out-dir DIR] [--agent-fn module:function] [--modes episode,agent] [key=value ...]

For each seed, one `python -m jobs.train` per mode, one after the other (each a job on its own local Ray, as
a user runs it; round-robin by seed, so a machine whose load drifts slows both modes alike): `episode`, the
config's `rollout.episode_fn` (the handle), and `agent`, the same job with `rollout.agent_fn` (default the
embedded task's loop written with `openai.AsyncOpenAI`, april_ray/task/lookup_openai.py), which replaces it.
A seed sets `train.seed` and `engine.seed`, as jobs.bench.train does. Without overrides: 40 steps, held-out
accuracy at steps 20 and 40, wandb off, no dashboard.

Per run: held-out accuracy before and after and its gain, the phase times and idle shares of the job's
summary, and the agent endpoint's counters summed over the run's steps (`rollout/agent_requests`,
`_resumed`, `_mismatch`, `_errors` from metrics.jsonl). Per mode: the gains' mean, standard deviation and
range, the rollout seconds' mean; `gain_ratio` is the agent's mean gain over the episode's, and
`rollout_s_ratio` the agent's mean rollout seconds over the episode's. The result is written after each run.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jobs.common import parse, write_result

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ["train.num_steps=40", "train.eval_every=20", "logging.wandb_mode=disabled", "logging.dashboard=false"]
AGENT_KEYS = ("rollout/agent_requests", "rollout/agent_resumed", "rollout/agent_mismatch", "rollout/agent_errors")
MODES = ("episode", "agent")


def mode_overrides(mode: str, agent_fn: str) -> list[str]:
    """The overrides that choose `mode`: the agent replaces the config's episode function."""
    return [f"rollout.agent_fn={agent_fn}"] if mode == "agent" else []


def run_command(args, mode: str, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "jobs.train", "--config", args.config, *DEFAULTS, *args.overrides,
            *mode_overrides(mode, args.agent_fn), f"train.seed={seed}", f"engine.seed={seed}",
            f"train.output_dir={out / mode / f'seed{seed}'}", "--summary", str(out / f"{mode}_seed{seed}.json")]


def agent_totals(metrics: Path) -> dict[str, float]:
    """The agent endpoint's counters summed over the training rows of `metrics.jsonl`."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    trained = [r for r in rows if "train/version" in r]
    return {k: sum(r.get(k, 0) for r in trained) for k in AGENT_KEYS}


def run_once(args, mode: str, seed: int, out: Path) -> dict:
    """One job; its summary, gain and agent counters (the job's log beside its summary)."""
    cmd = run_command(args, mode, seed, out)
    log = out / f"{mode}_seed{seed}.log"
    t0 = time.time()
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=os.environ).returncode
    if code != 0:
        raise RuntimeError(f"{mode} seed {seed} exited {code}; see {log}:\n" + log.read_text()[-3000:])
    summary = json.loads((out / f"{mode}_seed{seed}.json").read_text())
    return {"mode": mode, "seed": seed, "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"],
            "gain": summary["accuracy_after"] - summary["accuracy_before"], "history": summary["history"],
            "time_s": summary["time_s"], "engine_idle_fraction": summary["engine_idle_fraction"],
            "learner_idle_fraction": summary["learner_idle_fraction"], "wall_s": round(time.time() - t0, 1),
            "load_average": os.getloadavg(), "agent_totals": agent_totals(Path(summary["output_dir"]) / "metrics.jsonl")}


def mode_report(runs: list[dict]) -> dict:
    gains = [r["gain"] for r in runs]
    return {"seeds": [r["seed"] for r in runs], "gains": gains, "gain_mean": statistics.mean(gains),
            "gain_sd": statistics.stdev(gains) if len(gains) > 1 else None, "gain_min": min(gains),
            "gain_max": max(gains), "rollout_s_mean": statistics.mean(r["time_s"]["rollout_s"] for r in runs)}


def report(runs: list[dict], command: str) -> dict:
    modes = {m: mode_report([r for r in runs if r["mode"] == m]) for m in MODES if any(r["mode"] == m for r in runs)}
    result = {"command": command, "runs": runs, "modes": modes}
    if len(modes) == 2:
        episode, agent = modes["episode"], modes["agent"]
        result["gain_ratio"] = agent["gain_mean"] / episode["gain_mean"] if episode["gain_mean"] else None
        result["rollout_s_ratio"] = agent["rollout_s_mean"] / episode["rollout_s_mean"]
    return result


def extra_args(p) -> None:
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--json", help="write the result here (after each run)")
    p.add_argument("--out-dir", default="outputs/bench_agent", help="the jobs' output directories and logs")
    p.add_argument("--agent-fn", default="april_ray.task.lookup_openai:agent")
    p.add_argument("--modes", default=",".join(MODES))


def main() -> None:
    _, args = parse(__doc__, extra_args)  # the config checked here, before any job starts
    if not args.config:
        raise SystemExit("--config: required (the job both modes run)")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes {args.modes}: expected a comma list of {', '.join(MODES)}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m jobs.bench.agent", *sys.argv[1:]])
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for mode in modes:
            runs.append(run_once(args, mode, seed, out))
            print(f"{mode} seed {seed}: {runs[-1]['accuracy_before']:.3f} -> {runs[-1]['accuracy_after']:.3f}, "
                  f"rollout {runs[-1]['time_s']['rollout_s']:.0f} s, {runs[-1]['agent_totals']}", flush=True)
            if args.json:  # a bench stopped early keeps its finished runs
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(report(runs, command), indent=2))
    write_result(args.json, report(runs, command))


if __name__ == "__main__":
    main()
