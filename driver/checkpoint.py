"""Checkpoints of a training job.

A checkpoint is one directory `ckpt-<step>`, written under a temporary name and renamed into place when
complete, then `latest` is pointed at it (both renames are atomic; `latest` holds a name, never a path,
and one that leaves the output directory is refused). It holds tensors and JSON only: the policy in
Hugging Face format (safetensors), the optimiser state (safetensors, `april_ray/learn/safe_state.py`),
`rollout_state.json` and, written last, `manifest.json` (every file of the checkpoint with its size and
sha256, checked before anything is read). Nothing in a checkpoint is ever unpickled: a file that is
neither safetensors nor text is refused by name (`check_contents`), and the loaders cannot unpickle. `rollout_state.json` is plain JSON, never a pickle, with a
schema name and version: the step, the policy version, the prompt cursor, the partial-rollout store
(every sample's token ids, behaviour logprobs, per-token versions, state and reward) and the monitor's
counters, all taken at the same moment between two steps, so a restart neither skips the prompts
waiting in the store nor repeats any (the cursor alone has already moved past the prompts of the
partial groups).

`find_checkpoint` takes the newest complete checkpoint of this run and says which incomplete ones (a
crash mid-write, a `latest` pointing at a missing directory, a link out of the output directory) and which
of other runs it passed over. A run is a lineage: a fresh job (`train.resume=false`) starts a new one in
`train.output_dir` (`start_run`: its id in the file `run`, and in every checkpoint's manifest), and a
resume goes on with it. A resume never picks up, nor writes over, the checkpoint of another run: one
there stops it (`open_run`), named (checkpoints written before run ids, without one, are taken by any
run). The step and version a checkpoint claims are checked against its name, its manifest and the job's
train.num_steps (`read_state`, `open_run`). A checkpoint of the older pickle format (`state.pkl`) is
refused, never unpickled: loading a pickle runs code from the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
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
    """The checkpoint the `latest` pointer names (which may be gone or incomplete); None without one. A
    pointer that names anything but a `ckpt-<step>` in `out_dir` (a path, `..`) is refused."""
    pointer = out_dir / LATEST
    if not pointer.is_file():
        return None
    if not pointer.resolve().is_relative_to(out_dir.resolve()):
        raise CheckpointError(f"{pointer}: a link to {pointer.resolve()}, outside {out_dir}; refused (delete "
                              f"{pointer} to resume from the newest complete checkpoint)")
    name = pointer.read_text().strip()
    if not _NAME.fullmatch(name):
        raise CheckpointError(f"{pointer}: names {name!r:.80}, not a ckpt-<step> directory of {out_dir}; "
                              f"refused (delete {pointer} to resume from the newest complete checkpoint)")
    return out_dir / name


def current_run(out_dir: Path) -> str | None:
    """The run id the file `run` of an output directory names (None: none there)."""
    f = out_dir / RUN_FILE
    return (f.read_text().strip() or None) if f.is_file() else None


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def start_run(out_dir: Path, resume: bool, new_run: str | None = None) -> str:
    """This job's run id. A resume's is the one in `out_dir/run` (with none there: that of the checkpoint
    `latest` names, or else of the newest complete one, so checkpoints copied into a new directory are
    still resumed from). A fresh job writes a new one (`new_run`, if given) and drops the `latest`
    pointer, which names an earlier run's checkpoint."""
    run = None
    if resume:
        if run := current_run(out_dir):
            return run
        named = named_by_latest(out_dir)
        ckpt = named if named is not None and incomplete_reason(named) is None else find_checkpoint(out_dir, lambda _: None)
        run = _run_of(ckpt) if ckpt is not None else None
    else:
        (out_dir / LATEST).unlink(missing_ok=True)
    run = run or new_run or new_run_id()
    _write(out_dir / RUN_FILE, run)
    return run


def open_run(out_dir: Path, train, log=print, new_run: str | None = None) -> Path | None:
    """Start this job's run in `out_dir`; returns the checkpoint to resume from (None: step 0), its
    contents and state checked (`check_contents`, `read_state`) before anything starts.

    A fresh job (`train.resume=false`) never erases an earlier run: its files are moved to
    `out_dir/runs/<its run id>` first (`set_aside`), and it starts run `new_run` (None: a new id). A
    resume goes on with the run of `out_dir`. It stops, naming each checkpoint and why, when another
    run's checkpoints are there (its saves would write over them), or when its own saved checkpoints are
    all unusable (its next save would overwrite one), unless `train.start_over`: then it starts a new run
    as a fresh job does. A checkpoint past train.num_steps stops it too: there is nothing left to train."""
    if train.resume:
        run = start_run(out_dir, resume=True)
        foreign = other_runs(out_dir, run)
        rejected = list(foreign)
        ckpt = find_checkpoint(out_dir, log, run, rejected)
        if not foreign and (ckpt is not None or not rejected):
            return ckpt if ckpt is None else checked(ckpt, train.num_steps)
        if not train.start_over:
            what = "another run's checkpoints are" if foreign else "no usable checkpoint is"
            raise CheckpointError(
                f"train.resume: {what} in {out_dir}; {_rejections(rejected)}. Nothing was changed. Repair or move "
                f"them, or add train.start_over=true to start a new run from step 0 (this directory's run files are "
                f"moved to {out_dir / EARLIER_RUNS} first).")
        log(f"checkpoint: train.start_over: {len(rejected)} checkpoints rejected; starting a new run")
    set_aside(out_dir, log)
    start_run(out_dir, resume=False, new_run=new_run)
    return None


def _rejections(rejected: list[tuple[Path, str]], most: int = 5) -> str:
    """`ckpt-000004, ckpt-000009: why; ckpt-000010: why`: the checkpoints of one reason together."""
    by_reason: dict[str, list[str]] = {}
    for path, why in rejected:
        by_reason.setdefault(why, []).append(path.name)
    return "; ".join(", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
                     + f": {why}" for why, names in by_reason.items())


def other_runs(out_dir: Path, run: str) -> list[tuple[Path, str]]:
    """(path, why) of each checkpoint in `out_dir` whose manifest names a run other than `run`, complete or
    not: a resume of `run` saving its steps would write over them. Only the run id is read."""
    found = []
    for path in sorted(out_dir.glob("*ckpt-*")):
        if not _NAME.search(path.name) or path.name.startswith(".tmp") or _link_reason(path) is not None:
            continue
        try:
            other = json.loads((path / MANIFEST).read_text()).get("run")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(other, str) and other != run:
            found.append((path, f"belongs to run {other}, not to run {run} that {out_dir / RUN_FILE} names"))
    return found


def checked(ckpt: Path, num_steps: int) -> Path:
    """`ckpt`, once its files and state are found usable and its step is before `num_steps`."""
    check_contents(ckpt)
    state = read_state(ckpt)
    if state["step"] >= num_steps:
        raise CheckpointError(f"{ckpt / STATE_FILE}: step {state['step']} is past train.num_steps={num_steps}: "
                              f"nothing left to train. Nothing was changed; raise train.num_steps to go on")
    return ckpt


EARLIER_RUNS = "runs"
RUN_RECORDS = {RUN_FILE, LATEST, "config.yaml", "wandb_run_id", "wandb", "tensorboard", "weights"}
"""What a run leaves in its output directory besides its checkpoints and `*.jsonl` step logs."""


def set_aside(out_dir: Path, log=print) -> Path | None:
    """Move an earlier run's files in `out_dir` (records, step logs, checkpoints) to
    `out_dir/runs/<its run id>`, where `train.output_dir=<that directory> train.resume=true` goes on with it.
    Other files stay. Returns where they went (None: there were none)."""
    mine = [p for p in out_dir.iterdir() if p.name in RUN_RECORDS or p.suffix == ".jsonl" or _NAME.search(p.name)]
    if not mine:
        return None
    name = current_run(out_dir) or "unnamed"
    if not re.fullmatch(r"[\w-]{1,64}", name):  # a run id is hex: anything else is not made a path
        name = "unnamed"
    dest = out_dir / EARLIER_RUNS / name
    n = 1
    while dest.exists():
        n += 1
        dest = out_dir / EARLIER_RUNS / f"{name}-{n}"
    dest.mkdir(parents=True)
    for p in mine:
        p.rename(dest / p.name)
    log(f"{out_dir} held an earlier run: its {len(mine)} files moved to {dest} (nothing deleted; "
        f"train.output_dir={dest} train.resume=true continues it)")
    return dest


def save_checkpoint(out_dir: Path, step: int, version: int, learners, rollout) -> Path:
    """Everything a resume needs, taken between two steps (after `step`, at policy `version`)."""
    source, store, monitor = ray.get([rollout.source.state_dict.remote(), rollout.store.state_dict.remote(),
                                      rollout.monitor.state_dict.remote()])
    return write_checkpoint(out_dir, rollout_state(step, version, source, store, monitor), learners.save)


def rollout_state(step: int, version: int, source: dict, store: dict, monitor: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "step": step, "version": version,
            "source": source, "store": store,
            "monitor": {k: monitor[k] for k in ("returned_groups", "dropped_groups", "over_sampling", "reward_per_group")
                        if k in monitor}}


def write_checkpoint(out_dir: Path, state: dict, save_policy) -> Path:
    """`save_policy(dir)` writes the policy and optimiser; then the rollout state, then the manifest."""
    path = out_dir / f"ckpt-{state['step']:06d}"
    tmp = out_dir / f".tmp-{path.name}"
    for stale in out_dir.glob(".tmp-ckpt-*"):  # this one, or saves a killed run left unfinished
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_policy(str(tmp))
    _write(tmp / STATE_FILE, json.dumps(state))
    files = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(tmp.rglob("*")) if f.is_file()}
    _write(tmp / MANIFEST, json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "step": state["step"],
                                       "run": current_run(out_dir), "files": files}, indent=1))
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


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _link_reason(path: Path) -> str | None:
    """Why `path` (a checkpoint directory of an output directory) reaches outside it (None: it does not):
    the directory a link out of the output directory, or anything in it a link out of the checkpoint or not
    a plain file or directory (a FIFO, a device). Nothing is read."""
    root = path.resolve()
    if not root.is_relative_to(path.parent.resolve()):
        return f"a link to {root}, outside {path.parent}"
    for where, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(where) / name
            if entry.is_symlink():
                if not entry.resolve().is_relative_to(root):
                    return f"{entry.relative_to(path)} is a link to {entry.resolve()}, outside the checkpoint"
            elif not (stat.S_ISREG(mode := entry.lstat().st_mode) or stat.S_ISDIR(mode)):
                return f"{entry.relative_to(path)} is not a plain file"
    return None


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (None: it is): a link out of the output directory, a file
    missing, or not as the manifest says (size, then sha256), or the manifest's step not the step of its
    name. Raises on the refused pickle format."""
    if (reason := _link_reason(path)) is not None:
        return reason
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
    if not isinstance(files, dict) or STATE_FILE not in files:
        return f"{MANIFEST}: files must be an object naming {STATE_FILE}, got {json.dumps(files)[:60]}"
    if "step" in manifest and manifest["step"] != _step(path):
        return f"{MANIFEST}: step {manifest['step']!r:.40}, not the step of its name ({_step(path)})"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
            return f"{MANIFEST}: {name}: no size and sha256 (a checkpoint of an older april-ray, or not one)"
    for name, entry in files.items():
        f = path / name
        if not f.resolve().is_relative_to(path.resolve()):
            return f"{MANIFEST}: {name} is outside the checkpoint"
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['size']}"
    for name, entry in files.items():
        if _sha256(path / name) != entry["sha256"]:
            return f"{name}: sha256 differs from the manifest's (changed since it was saved)"
    return None


def find_checkpoint(out_dir: Path, log=print, run: str | None = None, rejected: list | None = None) -> Path | None:
    """The newest complete checkpoint in `out_dir` of run `run` (any run's if None; one without a run id
    is any run's), None if there is none; every incomplete one newer than it, every one of another run,
    and a `latest` pointer that disagrees, are reported through `log`. Each saved one it passes over (not
    an unfinished save, nor another run's: `other_runs` names those) is appended to `rejected` as (path,
    reason)."""
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
        if rejected is not None and not path.name.startswith(".tmp"):
            rejected.append((path, reason))
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
    """`rollout_state.json`, validated: a CheckpointError names the file and the field. Its step is the
    step of the checkpoint's name, its policy version at most one per step trained, and no stored token
    is of a newer version."""
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
    if state["step"] != _step(path):
        raise CheckpointError(f"{file}: step: {state['step']}, not the step of its checkpoint ({path.name})")
    if state["version"] > state["step"] + 1:
        raise CheckpointError(f"{file}: version: {state['version']}, more than one per step trained "
                              f"(step {state['step']})")
    from april_ray.rollout.store import PartialRolloutStore

    store = PartialRolloutStore()  # it validates every group and sample before it takes any; a copy thrown away
    try:
        store.load_state_dict(state.get("store"), "store")
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    newest = max((v for g in [*store.partial.values(), *store.complete] for s in g.samples for v in s.versions),
                 default=0)
    if newest > state["version"]:
        raise CheckpointError(f"{file}: store: a token of policy version {newest}, newer than the checkpoint's "
                              f"version {state['version']}")
    return state


TENSOR_SUFFIXES = {".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".pkl"}
"""Files that must be safetensors (DeepSpeed names its files `.pt`; ours are safetensors inside)."""


def check_contents(path: Path) -> None:
    """Every file of the checkpoint is what its loader reads without unpickling: safetensors where a
    tensor file is expected (`TENSOR_SUFFIXES`), else UTF-8 text (JSON, tokenizer files, DeepSpeed's
    `latest`), and no Python source. A CheckpointError names the first file that is not."""
    from safetensors import SafetensorError, safe_open

    for name in json.loads((path / MANIFEST).read_text())["files"]:
        f = path / name
        if f.suffix in TENSOR_SUFFIXES:
            try:
                with safe_open(str(f), "pt") as opened:
                    opened.keys()
                continue
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: not a safetensors file ({e}); refused, never unpickled (a "
                                      f"checkpoint holds tensors and JSON only)") from None
        try:
            f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{f}: neither safetensors nor text; refused (a checkpoint holds tensors "
                                  f"and JSON only)") from None
        if f.suffix == ".py":
            raise CheckpointError(f"{f}: Python source in a checkpoint; refused")


def restore_checkpoint(path: Path, learners, rollout, engines) -> tuple[int, int]:
    """Load everything saved at `path`; returns (next step, policy version)."""
    check_contents(path)
    state = read_state(path)
    try:
        ray.get([rollout.source.load_state_dict.remote(state.get("source")),
                 rollout.store.load_state_dict.remote(state["store"]),
                 rollout.monitor.load_state_dict.remote(state["monitor"])])
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise CheckpointError(f"{path / STATE_FILE}: {e.cause}") from None
        raise
    learners.load(str(path))
    learners.publish(engines, state["version"])
    return state["step"] + 1, state["version"]
