"""Chunked, checkpointed log-probs (and the packed layout) give the plain path's values and gradients."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from april_ray.learn.logprobs import num_chunks, packed_layout, padded_layout, selected_logprobs, token_logprobs


def tiny_model(vocab=1000, checkpointing=False):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).float()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def batch(vocab=1000):
    """Two right-padded rows (lengths 12 and 7) with their response positions (prompts of 4 and 3)."""
    g = torch.Generator().manual_seed(1)
    lengths, prompts = [12, 7], [4, 3]
    ids = torch.zeros(2, 12, dtype=torch.long)
    positions = torch.zeros(2, 11)
    for r, (n, p) in enumerate(zip(lengths, prompts)):
        ids[r, :n] = torch.randint(0, vocab, (n,), generator=g)
        positions[r, p - 1 : n - 1] = 1
    return ids, lengths, positions


def loss_and_grads(model, logp, positions):
    weights = torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)  # every position weighs differently
    model.zero_grad(set_to_none=True)
    ((logp * weights * positions).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk_tokens", [0, 1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_the_plain_path_in_values_and_gradients(chunk_tokens, temperature):
    model = tiny_model()
    ids, _, positions = batch()
    plain = token_logprobs(model, ids, temperature)
    want_grads = loss_and_grads(model, plain, positions)
    layout = padded_layout(ids, positions)
    chunked = selected_logprobs(model, layout, temperature, num_chunks(len(layout.src), chunk_tokens))
    grads = loss_and_grads(model, chunked, positions)
    torch.testing.assert_close(chunked * positions, plain * positions, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():  # float32 sums in another order (chunks, threads): 1.7e-6 apart seen
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5)


def test_packed_layout_with_activation_checkpointing_matches_padded_rows():
    ids, lengths, positions = batch()
    plain_model, model = tiny_model(), tiny_model(checkpointing=True)
    plain = token_logprobs(plain_model, ids, 1.0)
    want_grads = loss_and_grads(plain_model, plain, positions)
    layout = packed_layout(ids, lengths, positions)
    assert layout.input_ids.shape == (1, sum(lengths)) and layout.position_ids[0, 12:].tolist() == list(range(7))
    packed = selected_logprobs(model, layout, 1.0, 3)
    grads = loss_and_grads(model, packed, positions)
    torch.testing.assert_close(packed * positions, plain * positions, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)


def test_no_grad_chunks_and_empty_selection():
    model = tiny_model()
    ids, _, positions = batch()
    with torch.no_grad():
        plain = token_logprobs(model, ids, 1.0)
        chunked = selected_logprobs(model, padded_layout(ids, positions), 1.0, 5)
        empty = selected_logprobs(model, padded_layout(ids, torch.zeros_like(positions)), 1.0, 2)
    torch.testing.assert_close(chunked * positions, plain * positions)
    assert not empty.any()
