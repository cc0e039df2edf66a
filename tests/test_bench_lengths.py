"""jobs.bench.lengths: the response-length percentiles of a config's task, and the plot beside another's."""
import json
import subprocess
import sys

from tests.conftest import USER_ENV


def test_lengths_of_the_long_tail_config_and_the_default(tmp_path):
    out, png = tmp_path / "lengths.json", tmp_path / "lengths.png"
    subprocess.run([sys.executable, "-m", "jobs.bench.lengths", "--config", "configs/tiny_cpu_longtail.yaml",
                    "--compare", "configs/tiny_cpu.yaml", "--plot", str(png), "--json", str(out),
                    "task.num_train=2000", f"model.cache_dir={tmp_path}"],
                   check=True, env=USER_ENV | {"APRIL_RAY_CACHE": str(tmp_path)}, capture_output=True)
    res = json.loads(out.read_text())
    tail, default = res["tiny_cpu_longtail"], res["tiny_cpu"]
    assert tail["num"] == 2000 and tail["max"] == 2001  # 400 terms of 5 tokens, and EOS
    assert tail["p50"] <= tail["p90"] <= tail["p99"] <= tail["max"] <= tail["cap"]
    assert tail["p99"] > 1000 > 10 * tail["p50"]  # a long tail: p99 in the thousands, median tens
    assert tail["p99"] > 3 * default["p99"] and default["max"] <= default["cap"]
    assert png.stat().st_size > 10_000
