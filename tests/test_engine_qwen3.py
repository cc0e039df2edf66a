"""The engine's own Qwen3 loader (april_ray/engine/qwen3.py) against transformers': the same parameters under the
same names, the same greedy tokens through our engine as `model.generate` gives, and what it refuses."""
import json
import subprocess
import sys

import pytest
import torch

from april_ray.engine.cpu_engine import LLMEngine
from april_ray.engine.qwen3 import load_qwen3
from april_ray.model import load_policy
from april_ray.types import GenerateRequest
from tests.test_engine import PROMPTS, greedy, hf_greedy, requests


def same_weights(ours, hf) -> None:
    a, b = ours.state_dict(), hf.state_dict()
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    tied = ours.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied == \
           (hf.lm_head.weight is hf.model.embed_tokens.weight)


def test_the_embedded_shape_loads_as_transformers_loads_it_and_generates_its_greedy_tokens(random_model_dir):
    ours, (hf, tok) = load_qwen3(random_model_dir), load_policy(random_model_dir)
    same_weights(ours, hf)
    assert ours.config.eos_token_id == (tok.eos_token_id,)
    outs = LLMEngine(ours, max_num_seqs=4, max_model_len=128).generate(requests(tok, greedy(20)))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, tok.encode(p), 20) for p in PROMPTS]


def test_an_untied_sharded_bf16_checkpoint_with_biases_loads_as_transformers_loads_it(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                         tie_word_embeddings=False, eos_token_id=[1, 2],
                         rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50KB")
    from april_ray.task.tokenizer import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    ours, (hf, _) = load_qwen3(tmp_path), load_policy(tmp_path)
    same_weights(ours, hf)
    assert ours.config.eos_token_id == (1, 2) and ours.config.rope_parameters["rope_theta"] == 5e5
    assert ours.lm_head.weight.dtype == torch.float32
    assert load_qwen3(tmp_path, torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    ids = [[5, 9, 13, 40], [7, 7, 3]]
    outs = LLMEngine(ours, max_num_seqs=2, max_model_len=64).generate(
        [GenerateRequest(f"r{i}", x, greedy(12)) for i, x in enumerate(ids)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf, x, 12) for x in ids]


def write_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | fields))


@pytest.mark.parametrize("fields, says", [
    ({"model_type": "llama"}, "model_type 'llama'; the CPU engine runs Qwen3"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"num_hidden_layers": 3}, "missing ['model.layers.2."),
    ({"intermediate_size": 200}, "model.layers.0.mlp.gate_proj.weight (384, 128) where config.json makes (200, 128)"),
])
def test_a_checkpoint_the_engine_cannot_run_is_refused_naming_its_file(random_model_dir, tmp_path, fields, says):
    import shutil

    model = shutil.copytree(random_model_dir, tmp_path / "model")
    write_config(model, **fields)
    with pytest.raises(ValueError, match="config.json|model") as e:
        load_qwen3(model)
    assert says in str(e.value) and str(model) in str(e.value)


def test_loading_imports_no_transformers(random_model_dir):
    """What an engine process's start saves: transformers' modeling import is most of it."""
    probe = ("import sys; from april_ray.engine.qwen3 import load_qwen3; "
             f"load_qwen3({str(random_model_dir)!r}); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
