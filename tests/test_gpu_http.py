"""GPU checks of the HTTP engine path: our engine's server with the model on CUDA, and weights handed to it
by CUDA IPC (`engine.weight_handoff.send_tensors`); a real `sglang.launch_server` where SGLang is installed.

    python -m pytest -q -m gpu tests/test_gpu_http.py

Imports only torch, transformers, aiohttp, safetensors and april_ray's engine modules (no Ray, omegaconf
or DeepSpeed), so it runs on a bare GPU box.
"""
import asyncio
import importlib.util

import pytest
import torch

from april_ray.engine.sglang_client import SGLangEngine
from april_ray.engine.sglang_server import CPUServerLauncher, SGLangLauncher, ServerOptions
from april_ray.engine.weight_handoff import send_tensors
from april_ray.types import FinishReason, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPTS = ["0052-3:", "12-1:", "0999-2: 0997", "7-1:", "hello world", "0153-3: 0150 0147 0144"]
MAX_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen3 and the char tokenizer, built here (no april_ray.config, which needs omegaconf)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from april_ray.task.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("gpu-model")
    tok = build_tokenizer()
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=384, max_position_embeddings=1024,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).float().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval(),
            AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def cuda_server(model_dir, tmp_path_factory):
    opts = ServerOptions(str(model_dir), device="cuda", max_num_seqs=8, max_model_len=MAX_LEN, startup_timeout_s=300,
                         log_dir=str(tmp_path_factory.mktemp("logs")))
    srv = CPUServerLauncher().start(opts)
    yield srv
    srv.stop()


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def run(coro_fn, srv):
    async def main():
        client = SGLangEngine(srv.url, max_model_len=MAX_LEN, server=srv)  # with the server's keys
        try:
            return await coro_fn(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def greedy_outputs(c, prompts, n):
    return await asyncio.gather(*[c.generate(GenerateRequest(f"g{i}", ids, SamplingParams(0.0, max_new_tokens=n)))
                                  for i, ids in enumerate(prompts)])


def test_our_engine_on_cuda_matches_hf_greedy(cuda_server, model):
    model, tok = model
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = run(lambda c: greedy_outputs(c, prompts, 32), cuda_server)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, ids, 32) and out.finish_reason == FinishReason.LENGTH


def test_cuda_ipc_tensor_handoff_into_the_server(cuda_server, model):
    """The learner's CUDA tensors go by IPC handle (no copy through the host); the server then serves them."""
    model, tok = model
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    new = type(model)(model.config).cuda().eval()
    new.load_state_dict(model.state_dict())
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, device="cuda"))
    named = list(new.state_dict().items())
    assert all(t.is_cuda for _, t in named)

    async def main(c):
        await send_tensors(c, named, 5, flush_cache=True, bucket_mb=0.25)
        c.update_weights(None, 5)
        return await greedy_outputs(c, prompts, 24)

    outs = run(main, cuda_server)
    assert [o.token_ids for o in outs] == [hf_greedy(new, ids, 24) for ids in prompts]
    assert all(o.versions == [5] * 24 for o in outs)


def test_memory_release_and_resume_on_cuda(cuda_server, model):
    model, tok = model
    prompts = [tok.encode(p) for p in PROMPTS[:2]]

    async def main(c):
        await c.release_memory_occupation(["weights", "kv_cache"])
        released = (await c.request("GET", "/get_server_info"))["released"]
        await c.resume_memory_occupation(["weights"])
        await send_tensors(c, list(model.state_dict().items()), 6, flush_cache=True, bucket_mb=1)
        await c.resume_memory_occupation(["kv_cache"])
        return released, await greedy_outputs(c, prompts, 16)

    released, outs = run(main, cuda_server)
    assert released == ["kv_cache", "weights"]
    assert [o.token_ids for o in outs] == [hf_greedy(model, ids, 16) for ids in prompts]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here")
def test_real_sglang_server_greedy_matches_hf(model_dir, model, tmp_path_factory):
    model, tok = model
    opts = ServerOptions(str(model_dir), max_num_seqs=8, max_model_len=MAX_LEN, mem_fraction=0.3,
                         startup_timeout_s=600, log_dir=str(tmp_path_factory.mktemp("logs")),
                         extra_args=["--dtype", "float32", "--disable-cuda-graph"])
    srv = SGLangLauncher().start(opts)
    try:
        prompts = [tok.encode(p) for p in PROMPTS[:4]]
        outs = run(lambda c: greedy_outputs(c, prompts, 16), srv)
        assert [o.token_ids for o in outs] == [hf_greedy(model, ids, 16) for ids in prompts]
    finally:
        srv.stop()
