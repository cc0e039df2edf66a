"""Forward passes of a Qwen3-architecture model over a preallocated, slot-indexed KV cache.

The weights are the Hugging Face module's own (projections, norms and MLPs are called as they are), so an
in-place `load_state_dict` is a weight update. Only attention is ours: each sequence in the batch sits at
its own position, reads its own cache slot, and the batch is packed into slots 0..n-1 so decode reads
one contiguous view of the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    def __init__(self, model, num_slots: int, max_model_len: int):
        """`num_slots`: the running batch's slots first, then any slots that park aborted sequences."""
        cfg = model.config
        self.model = model
        self.layers = model.model.layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_model_len = max_model_len
        dtype = next(model.parameters()).dtype
        shape = (len(self.layers), num_slots, self.num_kv_heads, max_model_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def _qkv(self, attn, h: torch.Tensor, cos, sin):
        b, n = h.shape[:2]
        q = attn.q_norm(attn.q_proj(h).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(h).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _block(self, layer, x, attend):
        h = layer.input_layernorm(x)
        o = attend(layer.self_attn, h)
        b, n = x.shape[:2]
        x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x)).float()

    @torch.inference_mode()
    def prefill(self, token_lists: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run whole inputs (right-padded), fill their cache slots; logits at each last position [B, V]."""
        lens = torch.tensor([len(t) for t in token_lists])
        width = int(lens.max())
        ids = torch.zeros(len(token_lists), width, dtype=torch.long)
        for row, toks in enumerate(token_lists):
            ids[row, : len(toks)] = torch.tensor(toks)
        slot_idx = torch.tensor(slots)
        cos, sin = self.cos[:width], self.sin[:width]

        def attend(layer_idx):
            def fn(attn, h):
                q, k, v = self._qkv(attn, h, cos, sin)
                self.k_cache[layer_idx, slot_idx, :, :width] = k
                self.v_cache[layer_idx, slot_idx, :, :width] = v
                # Padding sits after each real token, so the causal mask already hides it.
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return fn

        x = self.model.model.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = self._block(layer, x, attend(i))
        last = x[torch.arange(len(token_lists)), lens - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, last_tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each running sequence; sequence i lives in slot i. Returns logits [B, V]."""
        b = len(last_tokens)
        pos = torch.tensor(positions)
        rows = torch.arange(b)
        cos, sin = self.cos[pos][:, None, None, :], self.sin[pos][:, None, None, :]
        buckets = self._span_buckets(pos)

        def attend(layer_idx):
            def fn(attn, h):
                q, k, v = self._qkv(attn, h, cos, sin)
                kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]
                kc[rows, :, pos] = k[:, :, 0]
                vc[rows, :, pos] = v[:, :, 0]
                if len(buckets) == 1:
                    _, span, mask = buckets[0]
                    return F.scaled_dot_product_attention(
                        q, kc[:b, :, :span], vc[:b, :, :span], attn_mask=mask, enable_gqa=True)
                out = torch.empty_like(q)
                for idx, span, mask in buckets:
                    out[idx] = F.scaled_dot_product_attention(
                        q[idx], kc[idx, :, :span], vc[idx, :, :span], attn_mask=mask, enable_gqa=True)
                return out
            return fn

        x = self.model.model.embed_tokens(torch.tensor(last_tokens))[:, None, :]
        for i, layer in enumerate(self.layers):
            x = self._block(layer, x, attend(i))
        return self._logits(x[:, 0])

    @staticmethod
    def _span_buckets(pos: torch.Tensor, min_span: int = 64):
        """Group sequences by power-of-two span, so a few long ones don't make every row attend over
        the longest context (on a long tail that padding was most of the decode time)."""
        span_of = torch.clamp(pos + 1, min=min_span)
        bucket = torch.ceil(torch.log2(span_of.float())).long()
        keys = torch.unique(bucket)
        if len(keys) == 1:
            span = int(pos.max()) + 1
            return [(None, span, (torch.arange(span)[None, :] <= pos[:, None])[:, None, None, :])]
        out = []
        for key in keys.tolist():
            idx = (bucket == key).nonzero()[:, 0]
            p = pos[idx]
            span = int(p.max()) + 1
            out.append((idx, span, (torch.arange(span)[None, :] <= p[:, None])[:, None, None, :]))
        return out

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of one slot into another (park, restore, repack)."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, logprobs under softmax(logits / temperature))."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_vals, _ = scaled.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, scaled.shape[-1]).clamp(max=scaled.shape[-1])
        kth = sorted_vals.gather(-1, (k - 1)[:, None])
        # Nucleus: keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        cum = sorted_vals.softmax(-1).cumsum(-1)
        cut = (cum - sorted_vals.softmax(-1) < top_p[:, None]).sum(-1, keepdim=True)
        pth = sorted_vals.gather(-1, (cut - 1).clamp(min=0))
        filtered = scaled.masked_fill(scaled < torch.maximum(kth, pth), float("-inf"))
    sampled = torch.multinomial(filtered.softmax(-1), 1, generator=generator)[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
