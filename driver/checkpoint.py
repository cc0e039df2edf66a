"""Checkpoints of a training job: their format, how one is saved and loaded, and how it is verified.

A checkpoint is one directory `ckpt-<step>`, written under a temporary name and renamed into place when
complete, then `latest` is pointed at it (both renames are atomic; `latest` holds a name, never a path,
and one that leaves the output directory is refused). It holds tensors and JSON only: the policy in
Hugging Face format (safetensors), the optimiser state (safetensors, `april_ray/learn/safe_state.py`),
`rollout_state.json` and, written last, `manifest.json` (every file of the checkpoint with its size and
sha256, checked before anything is read, and the id of the run that saved it). Nothing in a checkpoint is
ever unpickled: a file that is neither safetensors nor text is refused by name (`check_contents`), and the
loaders cannot unpickle. `rollout_state.json` is plain JSON, never a pickle, with a
schema name and version: the step, the policy version, the prompt cursor, the partial-rollout store
(every sample's token ids, behaviour logprobs, per-token versions, state and reward) and the monitor's
counters, all taken at the same moment between two steps, so a restart neither skips the prompts
waiting in the store nor repeats any (the cursor alone has already moved past the prompts of the
partial groups).

`find_checkpoint` takes the newest complete checkpoint of a run and says which incomplete ones (a crash
mid-write, a `latest` pointing at a missing directory, a link out of the output directory) and which of
other runs it passed over (checkpoints written before run ids, without one, are any run's). The step and
version a checkpoint claims are checked against its name, its manifest and the job's train.num_steps
(`read_state`, `checked`). A checkpoint of the older pickle format (`state.pkl`) is refused, never
unpickled: loading a pickle runs code from the file. Which run a job is, and what it does with other
runs' files, is `output_dir.py`'s.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

import ray

SCHEMA = "april-ray/rollout-state"
SCHEMA_VERSION = 1
STATE_FILE = "rollout_state.json"
MANIFEST = "manifest.json"
_NAME = re.compile(r"ckpt-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file (and the field)."""


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


def checked(ckpt: Path, num_steps: int) -> Path:
    """`ckpt`, once its files and state are found usable and its step is before `num_steps`."""
    check_contents(ckpt)
    state = read_state(ckpt)
    if state["step"] >= num_steps:
        raise CheckpointError(f"{ckpt / STATE_FILE}: step {state['step']} is past train.num_steps={num_steps}: "
                              f"nothing left to train. Nothing was changed; raise train.num_steps to go on")
    return ckpt


def save_checkpoint(out_dir: Path, run: str, step: int, version: int, learners, rollout) -> Path:
    """Everything a resume of run `run` needs, taken between two steps (after `step`, at policy `version`)."""
    source, store, monitor = ray.get([rollout.source.state_dict.remote(), rollout.store.state_dict.remote(),
                                      rollout.monitor.state_dict.remote()])
    return write_checkpoint(out_dir, rollout_state(step, version, source, store, monitor), learners.save, run)


def rollout_state(step: int, version: int, source: dict, store: dict, monitor: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "step": step, "version": version,
            "source": source, "store": store,
            "monitor": {k: monitor[k] for k in ("returned_groups", "dropped_groups", "over_sampling", "reward_per_group")
                        if k in monitor}}


def write_checkpoint(out_dir: Path, state: dict, save_policy, run: str | None) -> Path:
    """`save_policy(dir)` writes the policy and optimiser; then the rollout state, then the manifest, which
    names `run` (the job's run id, `output_dir.current_run`)."""
    path = out_dir / f"ckpt-{state['step']:06d}"
    tmp = out_dir / f".tmp-{path.name}"
    for stale in out_dir.glob(".tmp-ckpt-*"):  # this one, or saves a killed run left unfinished
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_policy(str(tmp))
    write_synced(tmp / STATE_FILE, json.dumps(state))
    files = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(tmp.rglob("*")) if f.is_file()}
    write_synced(tmp / MANIFEST, json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "step": state["step"],
                                       "run": run, "files": files}, indent=1))
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
    write_synced(out_dir / f"{LATEST}.tmp", path.name)
    (out_dir / f"{LATEST}.tmp").replace(out_dir / LATEST)
    return path


def write_synced(path: Path, text: str) -> None:
    """`text` in `path`, on disk before this returns."""
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
        other = run_of(path) if reason is None and run is not None else None
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


def run_of(path: Path) -> str | None:
    """The run id in a complete checkpoint's manifest (None: written before run ids)."""
    return json.loads((path / MANIFEST).read_text()).get("run")


def claimed_run(path: Path) -> str | None:
    """The run id a checkpoint directory's manifest names, complete or not; None where there is none to read
    (written before run ids, no readable manifest, an unfinished save) or the directory reaches outside."""
    if not is_checkpoint_name(path.name) or path.name.startswith(".tmp") or _link_reason(path) is not None:
        return None
    try:
        run = json.loads((path / MANIFEST).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def is_checkpoint_name(name: str) -> bool:
    """`ckpt-<step>`, or a copy of one being saved (`.tmp-`) or moved aside (`.old-`)."""
    return _NAME.search(name) is not None


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
