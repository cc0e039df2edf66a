"""A non-editable install carries every package: installed into a folder of its own, the training job
starts from another directory with the repository nowhere on `sys.path`."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = (".venv", ".git", ".gpu_bundle", "outputs", "wandb", "__pycache__", "*.egg-info", "build", ".pytest_cache",
        "tests")


def packages(root: Path) -> set[str]:
    """Every folder with an `__init__.py` under `root`, as a dotted name."""
    return {".".join(p.parent.relative_to(root).parts) for p in root.rglob("__init__.py")
            if not set(p.relative_to(root).parts) & {".venv", "tests", "build"}}


def test_a_non_editable_install_runs_the_training_job_from_elsewhere(tmp_path):
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    # A copy, so that the build's own folders are not written into the working tree.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*SKIP))
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--no-cache-dir", "--target", str(target), str(src)]
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert packages(src) <= packages(target), f"not packaged: {sorted(packages(src) - packages(target))}"

    # -S: no site-packages' .pth files, so this venv's editable install cannot map a package to the
    # repository; the dependencies come from the site folders named on PYTHONPATH after the install.
    sites = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *sites])}
    proc = subprocess.run([sys.executable, "-S", "-m", "jobs.train", "--help"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--config" in proc.stdout
