"""Checkpoints of a training job.

A checkpoint is one directory `ckpt-<step>`, written under a temporary name and renamed into place when
complete, then `latest` is pointed at it (both renames are atomic). It holds the policy in Hugging Face
format (safetensors), the optimiser state, `rollout_state.json` and, written last, `manifest.json`
(every file of the checkpoint with its size). `rollout_state.json` is plain JSON, never a pickle, with a
schema name and version: the step, the policy version, the prompt cursor, the partial-rollout store
(every sample's token ids, behaviour logprobs, per-token versions, state and reward) and the monitor's
counters, all taken at the same moment between two steps, so a restart neither skips the prompts
waiting in the store nor repeats any (the cursor alone has already moved past the prompts of the
partial groups).

`find_checkpoint` takes the newest complete checkpoint of this run and says which incomplete ones (a
crash mid-write, a `latest` pointing at a missing directory) and which of other runs it passed over. A run
is a lineage: a fresh job (`train.resume=false`) starts a new one in `train.output_dir` (`start_run`:
its id in the file `run`, and in every checkpoint's manifest), and a resume goes on with it, so a resume
never picks up the checkpoint of an earlier, unrelated run left in the same directory (checkpoints
written before run ids, without one, are taken by any run). A checkpoint of the older
pickle format (`state.pkl`) is refused, never unpickled: loading a pickle runs code from the file.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import ray

SCHEMA = "april-ray/rollout-state"
SCHEMA_VERSION = 1
STATE_FILE = "rollout_state.json"
MANIFEST = "manifest.json"
_NAME = re.compile(r"ckpt-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file (and the field)."""


RUN_FILE = "run"
LATEST = "latest"


def named_by_latest(out_dir: Path) -> Path | None:
    """The checkpoint the `latest` pointer names (which may be gone or incomplete); None without one."""
    pointer = out_dir / LATEST
    return out_dir / pointer.read_text().strip() if pointer.is_file() else None


def _run_file(out_dir: Path) -> str | None:
    f = out_dir / RUN_FILE
    return (f.read_text().strip() or None) if f.is_file() else None


def start_run(out_dir: Path, resume: bool) -> str:
    """This job's run id. A resume's is the one in `out_dir/run` (with none there: that of the checkpoint
    `latest` names, or else of the newest complete one, so checkpoints copied into a new directory are
    still resumed from). A fresh job writes a new one and drops the `latest` pointer, which names an
    earlier run's checkpoint."""
    run = None
    if resume:
        if run := _run_file(out_dir):
            return run
        named = named_by_latest(out_dir)
        ckpt = named if named is not None and incomplete_reason(named) is None else find_checkpoint(out_dir, lambda _: None)
        run = _run_of(ckpt) if ckpt is not None else None
    else:
        (out_dir / LATEST).unlink(missing_ok=True)
    run = run or uuid.uuid4().hex[:16]
    _write(out_dir / RUN_FILE, run)
    return run


def save_checkpoint(out_dir: Path, step: int, version: int, learners, rollout) -> Path:
    """Everything a resume needs, taken between two steps (after `step`, at policy `version`)."""
    source, store, monitor = ray.get([rollout.source.state_dict.remote(), rollout.store.state_dict.remote(),
                                      rollout.monitor.counters.remote()])
    return write_checkpoint(out_dir, rollout_state(step, version, source, store, monitor), learners.save)


def rollout_state(step: int, version: int, source: dict, store: dict, monitor: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "step": step, "version": version,
            "source": source, "store": store,
            "monitor": {k: monitor[k] for k in ("returned_groups", "dropped_groups")}}


def write_checkpoint(out_dir: Path, state: dict, save_policy) -> Path:
    """`save_policy(dir)` writes the policy and optimiser; then the rollout state, then the manifest."""
    path = out_dir / f"ckpt-{state['step']:06d}"
    tmp = out_dir / f".tmp-{path.name}"
    for stale in out_dir.glob(".tmp-ckpt-*"):  # this one, or saves a killed run left unfinished
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_policy(str(tmp))
    _write(tmp / STATE_FILE, json.dumps(state))
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    _write(tmp / MANIFEST, json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "step": state["step"],
                                       "run": _run_file(out_dir), "files": files}, indent=1))
    old = out_dir / f".old-{path.name}"
    if path.exists():  # a redone step's: moved aside, not deleted, until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    for moved in out_dir.glob(".old-ckpt-*"):  # this one, or one a kill left: back in place, or gone if replaced
        home = out_dir / moved.name[len(".old-"):]
        if home.exists():
            shutil.rmtree(moved, ignore_errors=True)
        else:
            moved.rename(home)
    _write(out_dir / f"{LATEST}.tmp", path.name)
    (out_dir / f"{LATEST}.tmp").replace(out_dir / LATEST)
    return path


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (None: it is). Raises on the refused pickle format."""
    if (path / "state.pkl").exists():
        raise CheckpointError(f"{path / 'state.pkl'}: a checkpoint of an older april-ray that keeps its rollout "
                              f"state as a pickle; it is refused, never unpickled (loading a pickle runs code "
                              f"from the file). Start without train.resume, or in a new train.output_dir.")
    if not path.is_dir():
        return "missing"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (written last: the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({e!r})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
    return None if STATE_FILE in files else f"{STATE_FILE} not in {MANIFEST}"


def find_checkpoint(out_dir: Path, log=print, run: str | None = None) -> Path | None:
    """The newest complete checkpoint in `out_dir` of run `run` (any run's if None; one without a run id
    is any run's), None if there is none; every incomplete one newer than it, every one of another run,
    and a `latest` pointer that disagrees, are reported through `log`."""
    named = named_by_latest(out_dir)
    candidates = [p for p in out_dir.glob("*ckpt-*") if _NAME.search(p.name)]
    if named is not None and named not in candidates:
        candidates.append(named)
    # of one step: the checkpoint, then the copy a redo of the step moved aside (a kill before the new one
    # took its place leaves only that one complete), then an unfinished save
    candidates.sort(key=lambda p: (_step(p), not p.name.startswith("."), not p.name.startswith(".tmp")),
                    reverse=True)
    for path in candidates:
        reason = "not finished (a save was interrupted)" if path.name.startswith(".tmp") else incomplete_reason(path)
        other = _run_of(path) if reason is None and run is not None else None
        if other is not None and other != run:
            log(f"checkpoint: {path} belongs to an earlier run ({other}, not this run's {run}); skipping it")
            continue
        if reason is None:
            if named is not None and named != path:
                log(f"checkpoint: {out_dir / LATEST} names {named.name}, but {path.name} is the newest complete one; "
                    f"resuming from {path.name}")
            return path
        log(f"checkpoint: {path} is incomplete ({reason}); skipping it for an older complete checkpoint")
    if candidates:
        log(f"checkpoint: no complete checkpoint in {out_dir}; starting from step 0")
    return None


def _run_of(path: Path) -> str | None:
    """The run id in a complete checkpoint's manifest (None: written before run ids)."""
    return json.loads((path / MANIFEST).read_text()).get("run")


def _step(path: Path) -> int:
    match = _NAME.search(path.name)
    return int(match.group(1)) if match else -1


def read_state(path: Path) -> dict:
    """`rollout_state.json`, validated: a CheckpointError names the file and the field."""
    file = path / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(state).__name__}")
    if state.get("schema") != SCHEMA:
        raise CheckpointError(f"{file}: schema: expected {SCHEMA!r}, got {state.get('schema')!r:.60}")
    if state.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{file}: schema_version: this april-ray reads version {SCHEMA_VERSION}, "
                              f"got {state.get('schema_version')!r}")
    for key, section in (("step", None), ("version", None), ("monitor", "returned_groups"),
                         ("monitor", "dropped_groups")):
        holder, name = (state, key) if section is None else (state.get(key), section)
        value = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            where = key if section is None else f"{key}.{section}"
            raise CheckpointError(f"{file}: {where}: expected a non-negative integer, got {value!r:.60}")
    from april_ray.rollout.store import PartialRolloutStore

    try:  # the store validates every group and sample before it takes any; this copy is thrown away
        PartialRolloutStore(0).load_state_dict(state.get("store"), "store")
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return state


def restore_checkpoint(path: Path, learners, rollout, engines) -> tuple[int, int]:
    """Load everything saved at `path`; returns (next step, policy version)."""
    state = read_state(path)
    try:
        ray.get([rollout.source.load_state_dict.remote(state.get("source")),
                 rollout.store.load_state_dict.remote(state["store"]),
                 rollout.monitor.restore_counters.remote(state["monitor"])])
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise CheckpointError(f"{path / STATE_FILE}: {e.cause}") from None
        raise
    learners.load(str(path))
    learners.publish(engines, state["version"])
    return state["step"] + 1, state["version"]
