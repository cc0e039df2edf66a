"""The folder handed to a lent GPU machine: what the training job needs that the machine's image lacks, packed.

    python -m jobs.gpu_check.bundle --out .gpu_bundle [--python 3.12] [--cache /tmp/gpu-bundle-cache] [--no-model]

The image (jobs/gpu_check/gpu_image_packages.txt) has CUDA torch and transformers 5.17 but no Ray, DeepSpeed or
OmegaConf, and the machine reaches no registry. This downloads the wheels it lacks for its Python and platform
(`WHEELS`), builds DeepSpeed as a pure-Python wheel (`DS_BUILD_OPS=0`), unpacks them all into one site
directory (Ray without Java, its libraries and its dashboard's web page: `DROP`; no .pyc), checks that every
requirement of every package there is either carried or on the image, and packs that directory with the embedded
model (built here once, on CPU: on the GPU machine its warm-up would spend device time): `site.tar.xz`
and `model.tar.xz`. It prints the bundle's size with the working tree that travels beside it, and fails when the
two pass `LIMIT_MIB`.

On the machine, before anything imports Ray: `. jobs/gpu_check/unpack.sh .gpu_bundle /tmp/april_ray_bundle`
(docs/gpu.md), which unpacks it and points PYTHONPATH and APRIL_RAY_CACHE there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
LIMIT_MIB = 60
"""The bundle and the working tree together: the issue's bound, 4 MiB under the 64 MiB the device tool carries."""

WHEELS = ("ray==2.60.0", "jsonschema==4.26.0", "referencing==0.37.0", "rpds-py==2026.9.1",
          "jsonschema-specifications==2025.9.1", "omegaconf==2.4.0", "transformers==5.24.0", "hjson==3.1.0",
          "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5")
"""Downloaded as binaries for the machine's Python: Ray (the version the CPU suite runs) and jsonschema's family,
the one core requirement of Ray's the image lacks; OmegaConf (its antlr runtime is vendored); the transformers the
learner needs (5.23 and newer have `activation_checkpointing_enable`); DeepSpeed's hjson and pydantic family."""
DEEPSPEED = "deepspeed==0.19.8"
"""A source distribution on the registry, built here without its ops (they JIT-compile on use, if ever)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
DROP = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/serve/", "ray/data/", "ray/llm/",
        "ray/dashboard/client/", "__pycache__/")
"""Paths left out of the site directory (a prefix, or a directory anywhere): Ray's Java, its libraries the job
does not import, and the dashboard's web page (the job runs with `logging.dashboard=false`)."""
NOT_CARRIED = {"wandb": "the job runs with logging.wandb_mode=disabled",
               "math-verify": "only task.reward_fn=april_ray.task.rewards:math_reward imports it",
               "sglang": "its kernels alone are a 536 MB wheel"}
"""The project's own requirements that neither the image nor the bundle holds, and why the job runs without them."""


@dataclass(frozen=True)
class Target:
    """The machine the bundle is for: its Python (x86-64 Linux, CPython)."""

    python: str = "3.12"

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    def markers(self) -> dict[str, str]:
        """The environment markers (PEP 508) a requirement is evaluated under, no extra asked."""
        return {"python_version": self.python, "python_full_version": self.python + ".0", "os_name": "posix",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}


def download(target: Target, cache: Path) -> list[Path]:
    """`WHEELS` for the target, kept in `cache/<abi>` (a second run downloads nothing), and DeepSpeed's wheel."""
    dest = cache / target.abi
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", target.python, "--implementation", "cp", *platforms, "-d", str(dest),
                    *WHEELS], check=True)
    built = cache / "any"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(built), DEEPSPEED],
                   check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    wanted = {canonicalize_name(Requirement(r).name): Requirement(r) for r in (*WHEELS, DEEPSPEED)}
    return [w for d in (dest, built) for w in sorted(d.glob("*.whl")) if wheel_matches(w, wanted)]


def wheel_matches(wheel: Path, wanted: dict[str, Requirement]) -> bool:
    """Whether a cached wheel is one of `wanted` at its pinned version (older downloads stay in the cache)."""
    name, version = wheel.name.split("-")[:2]
    req = wanted.get(canonicalize_name(name))
    return req is not None and req.specifier.contains(version, prereleases=True)


def dropped(path: str) -> bool:
    return any(path.startswith(d) or f"/{d}" in path for d in DROP) or path.endswith(".pyc")


def unpack_wheel(wheel: Path, site: Path) -> tuple[int, int]:
    """The wheel's files into `site` as an installer lays them out (`*.data/purelib` and `platlib` at the top;
    its scripts, headers and data left out), `DROP` left out too: (bytes kept, bytes dropped)."""
    kept = left = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = info.filename
            data_dir, _, rest = path.partition(".data/")
            if rest and "/" not in data_dir:
                kind, _, path = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    left += info.file_size
                    continue
            if info.is_dir() or dropped(path):
                left += info.file_size
                continue
            out = site / path
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if info.external_attr >> 16 & 0o111:  # Ray's gcs_server and raylet are executables
                out.chmod(0o755)
            kept += info.file_size
    return kept, left


def image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """Normalised name -> version (None where no session read it) of what the image holds."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = version or None
    return found


def site_packages(site: Path) -> dict[str, tuple[str, list[str]]]:
    """Normalised name -> (version, requirement lines) of every distribution unpacked in `site`."""
    found = {}
    for meta in site.glob("*.dist-info/METADATA"):
        text = meta.read_text(encoding="utf-8", errors="replace").split("\n\n")[0]
        fields = re.findall(r"^(Name|Version|Requires-Dist): (.+)$", text, flags=re.M)
        name = next(v for k, v in fields if k == "Name")
        found[canonicalize_name(name)] = (next(v for k, v in fields if k == "Version"),
                                          [v for k, v in fields if k == "Requires-Dist"])
    return found


def check_requirements(site: Path, target: Target, image: dict[str, str | None],
                       extra: list[str] = ()) -> tuple[list[str], dict[str, str | None]]:
    """(each requirement of the site's packages and of `extra` that neither the site nor the image meets,
    worded: missing on both, or the version there, where known, outside the requirement's range;
    what the image is relied on for: name -> version or None)."""
    carried = site_packages(site)
    wants = [(f"{name} {version}", line) for name, (version, lines) in carried.items() for line in lines]
    wants += [("the project", line) for line in extra]
    problems, from_image = [], {}
    for who, line in wants:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(target.markers()):
            continue
        name = canonicalize_name(req.name)
        if name not in carried and name not in image:
            problems.append(f"{who} requires {line}: neither the bundle nor the image has {req.name}")
            continue
        have, where = (carried[name][0], "the bundle") if name in carried else (image[name], "the image")
        if name not in carried:
            from_image[name] = have
        if have is not None and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{who} requires {line}: {where} has {req.name} {have}")
    return problems, dict(sorted(from_image.items()))


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's runtime requirements, but `NOT_CARRIED` and extras (Ray's `default`: no dashboard), and
    aiohttp, which the engine server imports and only Ray's `default` extra declares."""
    import tomllib

    lines = tomllib.loads(pyproject.read_text())["project"]["dependencies"] + ["aiohttp"]
    reqs = [Requirement(line) for line in lines]
    return [f"{r.name}{r.specifier}" for r in reqs if canonicalize_name(r.name) not in NOT_CARRIED]


def embedded_model(config: str, overrides: list[str]) -> Path:
    """The embedded model of `config` (built here if it is not yet), as jobs.train would use it."""
    from april_ray.config import load_config
    from april_ray.task.embedded_model import ensure_model

    cfg = load_config(config, overrides)
    if cfg.model.path:
        raise ValueError(f"--config {config}: model.path is set; only the embedded model (model.path='') is carried")
    return ensure_model(cfg)


def pack(folder: Path, arcname: str, archive: Path) -> None:
    """`folder` as `arcname` in an xz archive (preset 6)."""
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        tar.add(folder, arcname=arcname)


def tree_bytes(root: Path, leave_out: Path) -> int:
    """The working tree the device tool sends: tracked files and untracked ones git does not ignore, but `leave_out`."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.decode().split("\0")
    files = (root / n for n in names if n)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink() and leave_out not in f.parents)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def check_size(bundle: int, tree: int, limit_mib: float = LIMIT_MIB) -> str:
    """The line that reports the sizes; a ValueError when together they pass the limit."""
    mib = 2 ** 20
    line = (f"bundle {bundle / mib:.1f} MiB + working tree {tree / mib:.1f} MiB = {(bundle + tree) / mib:.1f} MiB "
            f"(limit {limit_mib:g} MiB; the device tool carries 64)")
    if bundle + tree > limit_mib * mib:
        raise ValueError(f"too large: {line}")
    return line


def build(args) -> dict:
    """The bundle in `args.out`: its manifest (what it holds, the sizes) is returned and written beside it."""
    target, out, cache = Target(args.python), Path(args.out).resolve(), Path(args.cache)
    wheels = download(target, cache)
    site = cache / f"site-{target.abi}"
    shutil.rmtree(site, ignore_errors=True)
    sizes = {w.name: unpack_wheel(w, site) for w in wheels}
    problems, from_image = check_requirements(site, target, image_packages(), project_requirements())
    if problems:
        raise ValueError("requirements the GPU machine would lack:\n  " + "\n  ".join(problems))
    model = None if args.no_model else embedded_model(args.config, args.overrides)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pack(site, "site", out / "site.tar.xz")
    if model is not None:
        pack(model, f"cache/models/{model.name}", out / "model.tar.xz")
    wheel_sizes = {name: {"kept_bytes": kept, "dropped_bytes": left} for name, (kept, left) in sizes.items()}
    manifest = {"python": target.python, "wheels": wheel_sizes,
                "site_bytes": folder_bytes(site), "model": model.name if model else None,
                "model_bytes": folder_bytes(model) if model else 0, "from_image": from_image,
                "not_carried": NOT_CARRIED}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))  # counted in the bundle's size, then
    manifest |= {"bundle_bytes": folder_bytes(out), "tree_bytes": tree_bytes(ROOT, out)}  # rewritten with it
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the bundle's folder (ignored by git: .gpu_bundle is)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (3.11 for a rehearsal here)")
    p.add_argument("--cache", default="/tmp/gpu-bundle-cache", help="downloaded and built wheels, kept")
    p.add_argument("--config", default="configs/tiny_cpu.yaml", help="whose embedded model to carry")
    p.add_argument("--no-model", action="store_true", help="carry no model (the job then builds it there)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of --config (those that name the model)")
    args = p.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python):
        p.error(f"--python: {args.python!r} is not a version like 3.12")
    try:
        manifest = build(args)
        line = check_size(manifest["bundle_bytes"], manifest["tree_bytes"])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.out}: {len(manifest['wheels'])} wheels unpacked to {manifest['site_bytes'] / 2**20:.1f} MiB, "
          f"model {manifest['model']}\n{line}")


if __name__ == "__main__":
    main()
