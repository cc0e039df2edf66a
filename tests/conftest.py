import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen3 + char tokenizer, saved as an HF directory (engine tests)."""
    from april_ray.config import ModelConfig
    from april_ray.model import build_random_model
    from april_ray.task.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("random-model")
    tok = build_tokenizer()
    model = build_random_model(ModelConfig(num_layers=2), len(tok), tok.pad_token_id, tok.eos_token_id, seed=3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def policy(random_model_dir):
    from april_ray.model import load_policy

    return load_policy(random_model_dir)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
