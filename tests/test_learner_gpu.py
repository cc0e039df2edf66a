"""The learner on a GPU (marked `gpu`, skipped without one): chunked bf16 log-probs against the plain path,
and the memory plan against the allocator's peak of a step with Qwen3's vocabulary."""
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_chunked_logprobs_under_bf16_autocast_match_the_plain_path_on_gpu():
    from tests.test_logprobs import batch, tiny_model

    from april_ray.learn.logprobs import num_chunks, padded_layout, selected_logprobs, token_logprobs

    model = tiny_model(vocab=32_000).cuda()
    ids, _, positions = (t.cuda() if torch.is_tensor(t) else t for t in batch(vocab=32_000))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = token_logprobs(model, ids, 1.0)
        layout = padded_layout(ids, positions)
        chunked = selected_logprobs(model, layout, 1.0, num_chunks(len(layout.src), 4))
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked * positions, plain * positions, rtol=0, atol=2e-2)


@pytest.mark.parametrize("option", ["both_on", "both_on_bf16"])
def test_the_plan_matches_the_allocator_peak_of_a_gpu_step(option):
    from jobs.bench.learner import build_model_dir, in_subprocess, predicted_bytes

    with tempfile.TemporaryDirectory() as work:
        model_dir = build_model_dir("10M", 151_936, Path(work) / "10M")
        got = in_subprocess("measure", model_dir=str(model_dir), option=option, tokens=4096, vocab=151_936, threads=4)
    assert predicted_bytes("10M", 151_936, option, 4096) == pytest.approx(got["peak_bytes"], rel=0.25)
