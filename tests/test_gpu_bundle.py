"""jobs/gpu_check/bundle.py without the network: a wheel unpacked as an installer would (Ray's unneeded parts left
out), the requirement check against the GPU image's list, the size accounting, and the archive unpacked by
jobs/gpu_check/unpack.sh onto PYTHONPATH and APRIL_RAY_CACHE."""
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jobs.gpu_check.bundle import (DROP, Target, check_requirements, check_size, image_packages, pack,
                                   project_requirements, tree_bytes, unpack_wheel, wheel_matches)
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def fake_wheel(path: Path, files: dict[str, bytes], executable: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name in executable else 0o644) << 16
            z.writestr(info, data)
    return path


def fake_dist(site: Path, name: str, version: str, requires: list[str]) -> None:
    meta = site / f"{name}-{version}.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True)
    meta.write_text("\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                               *(f"Requires-Dist: {r}" for r in requires)]) + "\n\nRequires-Dist: not-a-header\n")


def test_a_wheel_unpacks_as_installed_without_what_the_job_never_imports(tmp_path):
    files = {"ray/__init__.py": b"x" * 10, "ray/core/src/ray/raylet/raylet": b"e" * 7,
             "ray/jars/ray_dist.jar": b"j" * 100,
             "ray/rllib/algo.py": b"r" * 20, "ray/dashboard/client/build/main.js": b"d" * 30,
             "ray/dashboard/head.py": b"h" * 4, "ray/util/__pycache__/x.cpython-312.pyc": b"c" * 5,
             "ray/stray.pyc": b"p" * 6, "ray-2.60.0.dist-info/METADATA": b"Name: ray\n",
             "ray-2.60.0.data/purelib/ray_extra.py": b"u" * 3, "ray-2.60.0.data/scripts/ray": b"s" * 8}
    wheel = fake_wheel(tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", files,
                       executable=("ray/core/src/ray/raylet/raylet",))
    site = tmp_path / "site"
    kept, left = unpack_wheel(wheel, site)
    found = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert found == ["ray-2.60.0.dist-info/METADATA", "ray/__init__.py", "ray/core/src/ray/raylet/raylet",
                     "ray/dashboard/head.py", "ray_extra.py"]
    assert (kept, left) == (10 + 7 + 4 + 10 + 3, 100 + 20 + 30 + 5 + 6 + 8)
    assert os.stat(site / "ray/core/src/ray/raylet/raylet").st_mode & stat.S_IXUSR
    assert "ray/jars/" in DROP and "ray/data/" in DROP


def test_requirements_met_by_the_bundle_or_the_image_and_each_unmet_one_named(tmp_path):
    site = tmp_path / "site"
    fake_dist(site, "ray", "2.60.0", ["jsonschema", "click>=7.0", 'async-timeout; python_version < "3.11"',
                                      'pytest; extra == "test"'])
    fake_dist(site, "jsonschema", "4.26.0", ["rpds-py>=0.25"])
    fake_dist(site, "transformers", "5.24.0", ["tokenizers<0.24,>=0.23.1", "huggingface-hub>=9"])
    image = {"click": None, "tokenizers": "0.23.2", "huggingface-hub": "1.33.0", "torch": "2.11.0"}
    problems, from_image = check_requirements(site, Target("3.12"), image, ["transformers>=5.23", "torch>=3"])
    assert sorted(problems) == [
        "jsonschema 4.26.0 requires rpds-py>=0.25: neither the bundle nor the image has rpds-py",
        "the project requires torch>=3: the image has torch 2.11.0",
        "transformers 5.24.0 requires huggingface-hub>=9: the image has huggingface-hub 1.33.0"]
    assert from_image == {"click": None, "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "torch": "2.11.0"}
    # under Python 3.10 the marker holds, and the image has no async-timeout
    problems, _ = check_requirements(site, Target("3.10"), image)
    assert any(p.startswith('ray 2.60.0 requires async-timeout; python_version < "3.11"') for p in problems)


def test_the_image_list_and_the_project_requirements_as_the_bundle_reads_them():
    image = image_packages()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0" and image["huggingface-hub"] == "1.33.0"
    assert "click" in image and image["click"] is None
    assert not {"ray", "deepspeed", "omegaconf", "jsonschema", "pydantic", "hjson"} & set(image)
    reqs = {Requirement(r).name: r for r in project_requirements()}
    assert "wandb" not in reqs and "math-verify" not in reqs and "aiohttp" in reqs
    assert reqs["ray"].startswith("ray>=") and reqs["transformers"] == "transformers>=5.23"


def test_a_cached_wheel_counts_only_at_its_pinned_version(tmp_path):
    wanted = {"ray": Requirement("ray==2.60.0"), "rpds-py": Requirement("rpds-py==2026.9.1")}
    assert wheel_matches(Path("ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"), wanted)
    assert not wheel_matches(Path("ray-2.50.0-cp312-cp312-manylinux2014_x86_64.whl"), wanted)
    assert wheel_matches(Path("rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl"), wanted)
    assert not wheel_matches(Path("hjson-3.1.0-py3-none-any.whl"), wanted)


def test_size_accounting_fails_past_the_limit_naming_both_sizes():
    mib = 2 ** 20
    assert check_size(30 * mib, 4 * mib).startswith("bundle 30.0 MiB + working tree 4.0 MiB = 34.0 MiB (limit 60")
    with pytest.raises(ValueError, match=r"too large: bundle 58.0 MiB \+ working tree 4.0 MiB = 62.0 MiB"):
        check_size(58 * mib, 4 * mib)


def test_the_tree_counts_what_the_device_tool_sends_but_the_bundle(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text("ignored/\n")  # 9 bytes, untracked and not ignored: sent
    (repo / "tracked.py").write_bytes(b"t" * 100)
    subprocess.run(["git", "add", "tracked.py"], cwd=repo, check=True)
    (repo / "new.py").write_bytes(b"n" * 20)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big").write_bytes(b"i" * 1000)
    (repo / "bundle").mkdir()
    (repo / "bundle" / "site.tar.xz").write_bytes(b"b" * 500)  # not ignored here, and left out all the same
    assert tree_bytes(repo, repo / "bundle") == 9 + 100 + 20


def test_the_archive_unpacks_onto_pythonpath_and_the_cache(tmp_path):
    site, model, bundle = tmp_path / "site", tmp_path / "tiny-qwen3-countdown-0123456789", tmp_path / "bundle"
    (site / "carried_pkg").mkdir(parents=True)
    (site / "carried_pkg" / "__init__.py").write_text("VERSION = '9.9'\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    bundle.mkdir()
    pack(site, "site", bundle / "site.tar.xz")
    pack(model, f"cache/models/{model.name}", bundle / "model.tar.xz")
    target = tmp_path / "target"
    script = (f'. jobs/gpu_check/unpack.sh "{bundle}" "{target}" && '
              f'{sys.executable} -c "import carried_pkg; print(carried_pkg.VERSION)" && echo "$APRIL_RAY_CACHE"')
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["9.9", str(target / "cache")]
    assert (target / "cache" / "models" / model.name / "config.json").read_text() == "{}"
    missing = subprocess.run(["bash", "-c", f'. jobs/gpu_check/unpack.sh "{tmp_path / "none"}" "{target}"'], cwd=ROOT,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "site.tar.xz not found" in missing.stderr
