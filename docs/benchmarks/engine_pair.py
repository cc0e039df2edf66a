"""bench_engine's measurements (engine 64x128, HF generate, task mix, curve) for either tree, without the
transformers continuous-batching comparison (it sizes its cache from free memory and OOMs a shared box)."""
import importlib, json, statistics, sys
import torch
torch.set_num_threads(1)
try:
    be = importlib.import_module("jobs.bench.engine")
except ModuleNotFoundError:
    be = importlib.import_module("jobs.bench_engine")
from april_ray.config import load_config
from april_ray.model import ensure_model, load_policy
try:
    from april_ray.task.data import dataset_paths, read_examples
except ModuleNotFoundError:
    from april_ray.data import dataset_paths, read_examples
from april_ray.types import SamplingParams
cfg = load_config("configs/tiny_cpu.yaml")
model, tok = load_policy(ensure_model(cfg))
pool = [tok.encode(ex.prompt) for ex in read_examples(dataset_paths(cfg.task, cfg.model.cache_dir)[1])]
prompts = [pool[i % len(pool)] for i in range(256)]
max_len = max(map(len, prompts)) + be.NEW_TOKENS + 1
sp = SamplingParams(temperature=1.0, max_new_tokens=512, stop_token_ids=(tok.eos_token_id,))
task_len = max(map(len, pool)) + 513
eng, hf, task = [], [], []
for _ in range(3):
    eng.append(be.engine_tok_s(model, prompts[:64], 64, max_len))
    hf.append(be.hf_generate_tok_s(model, tok, prompts[:64]))
    task.append(be.task_mix_tok_s(model, pool, sp, 64, task_len, 5.0)[0])
curve = {c: be.engine_tok_s(model, prompts[:max(c, 4)], c, max_len) for c in (1, 4, 16, 64)}
out = {"engine_tok_s": statistics.median(eng), "hf_generate_tok_s": statistics.median(hf),
       "task_mix_tok_s": statistics.median(task), "runs": {"engine": eng, "hf": hf, "task": task}, "curve": curve}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out))
