"""Inputs a user gets wrong, each a clear error naming the file (and line): a config that is not YAML or
not a mapping, a dataset with blank lines before its rows or characters its tokenizer lacks; and two jobs
building the embedded model at once."""
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import ConfigError, load_config
from april_ray.task.data import fit_context, read_examples
from april_ray.task.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,message", [
    ("model:\n  path: [\n", r"bad\.yaml:3: not valid YAML"),
    ("model:\n\tpath: x\n", r"bad\.yaml:2: not valid YAML"),
    ("- model\n- engine\n", r"bad\.yaml: the top level must be a mapping of sections .* got a list"),
])
def test_a_config_file_that_is_not_a_yaml_mapping_is_named(tmp_path, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(tmp_path / "bad.yaml"))


def test_blank_lines_before_the_first_row_are_called_that(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('\n\n{"prompt": "p", "answer": "1"}\n')
    with pytest.raises(ValueError, match=rf"{f}:1: empty row \(a blank line before the first row\)"):
        read_examples(f)
    f.write_text('{"prompt": "p", "answer": "1"}\n\n{"prompt": "q", "answer": "2"}\n')
    with pytest.raises(ValueError, match=rf"{f}:2: empty row \(a blank line between rows\)"):
        read_examples(f)


def test_prompt_characters_outside_the_tokenizer_are_named_not_made_unknown(tmp_path):
    tok = build_tokenizer()
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1 + 2", "answer": "3"}\n{"prompt": "x² − 1 = 0", "answer": "1"}\n')
    examples = read_examples(f)
    with pytest.raises(ValueError, match=rf"{f}:2: prompt has characters the tokenizer does not know \('²−'\)"):
        fit_context(examples, tok.encode, 100, "fail", "task.overlong_prompts", unk_id=tok.unk_token_id)
    assert fit_context(examples[:1], tok.encode, 100, "fail", "task.overlong_prompts", unk_id=tok.unk_token_id)


BUILD = """
import sys
from april_ray.config import load_config
from april_ray.task.embedded_model import ensure_model
cfg = load_config(None, [f"model.cache_dir={sys.argv[1]}", "warmup.steps=3", "task.num_train=64", "model.num_layers=1"])
print(ensure_model(cfg, log=lambda _: None))
"""


def test_two_builds_of_the_embedded_model_at_once_both_succeed_and_touch_no_other_directory(tmp_path):
    from april_ray.config import load_config
    from april_ray.model import check_model_dir
    from april_ray.task.embedded_model import embedded_model_dir

    cfg = load_config(None, [f"model.cache_dir={tmp_path}", "warmup.steps=3", "task.num_train=64", "model.num_layers=1"])
    out = embedded_model_dir(cfg)
    other = out.with_name(out.name + ".tmp")  # the place another job's build used to share
    other.mkdir(parents=True)
    (other / "in-progress").write_text("another job's")
    builds = [subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for b in builds:
        stdout, stderr = b.communicate(timeout=600)
        assert b.returncode == 0, stderr[-3000:]
        assert Path(stdout.strip()) == out
    check_model_dir(out)
    assert (other / "in-progress").read_text() == "another job's"
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, other.name])
