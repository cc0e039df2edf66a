"""Forward passes of a Qwen3-architecture model over a preallocated, slot-indexed KV cache.

The weights are the Hugging Face module's own parameters, used by reference, so an in-place
`load_state_dict` is a weight update. The forward is ours, the same math as the module's with fewer ops
(a fused RMSNorm, projections without nn.Module calls: at this size the per-op overhead is most of a
small batch's step). In attention, each sequence sits at its own position and reads its own cache slot;
the running batch is packed into slots 0..n-1, and decode attends in a few contiguous ranges of it, each
over its own span (`decode_segments`). Fresh inputs are prefilled in the same pass as the decode step.
On a GPU, attention runs on PyTorch's flash, memory-efficient or math kernels, never cuDNN's: cuDNN plans
each new shape, and a decode span grows by a token every step (on an H200 that planning made a step of
Qwen3-1.7B take 50-90 ms instead of about 13, docs/gpu.md).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """The module's RMSNorm as one fused op (the Hugging Face module runs six)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _linear(proj, x: torch.Tensor) -> torch.Tensor:
    """A projection without nn.Module's call machinery: on a model this small, per-op overhead is the cost."""
    return F.linear(x, proj.weight, proj.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


MIN_SPAN = 64


def span_bucket(position: int) -> int:
    """Power-of-two class of the span a row at `position` attends over (at least MIN_SPAN)."""
    return (max(position + 1, MIN_SPAN) - 1).bit_length()


def decode_segments(positions: list[int], straggler_rows: int = 2) -> list[tuple[int, int, int]]:
    """Split the running batch, in slot order, into contiguous (start, end, span) row ranges of one span
    class each, so that a few long sequences do not make every row attend over the longest context (on
    a long tail that padding was most of the decode time), and no row is gathered out of the cache (on
    this CPU a gathered copy of the rows cost more than their attention). A run of at most
    `straggler_rows` shorter rows between two of one longer class joins them: padding a row costs less
    than a call (a finished row's slot is refilled with the last row, often a short one).
    The engine regroups the batch by span class when it fragments (`fragmented`, `grouping_order`),
    so there are few ranges."""
    runs: list[list[int]] = []  # [start, end, bucket, max position]
    for i, p in enumerate(positions):
        bucket = span_bucket(p)
        if runs and runs[-1][2] == bucket:
            runs[-1][1], runs[-1][3] = i + 1, max(runs[-1][3], p)
        else:
            runs.append([i, i + 1, bucket, p])
    merged: list[list[int]] = []
    for i, run in enumerate(runs):
        last = merged[-1] if merged else None
        sandwiched = (last is not None and i + 1 < len(runs) and runs[i + 1][2] == last[2] > run[2]
                      and run[1] - run[0] <= straggler_rows)
        if last and (run[2] == last[2] or sandwiched):
            last[1], last[3] = run[1], max(last[3], run[3])
        else:
            merged.append(run)
    return [(a, e, m + 1) for a, e, _, m in merged]


def fragmented(positions: list[int], segments: list[tuple[int, int, int]], slack: int = 2) -> bool:
    """More ranges than span classes (plus `slack`): long rows sit among short ones, regrouping pays."""
    return len(segments) > len({span_bucket(p) for p in positions}) + slack


def grouping_order(positions: list[int]) -> list[int]:
    """A permutation of the rows (new row i = old row order[i]) after which each span class is one
    contiguous range, longest class first, moving as few rows as possible: a row already inside its
    class's range stays, and each misplaced row takes a slot in its range that holds another class."""
    buckets = [span_bucket(p) for p in positions]
    ranges, start = {}, 0
    for b in sorted(set(buckets), reverse=True):
        n = buckets.count(b)
        ranges[b], start = (start, start + n), start + n
    order = list(range(len(positions)))
    for b, (a, e) in ranges.items():
        holes = [i for i in range(a, e) if buckets[i] != b]
        strays = [i for i, bi in enumerate(buckets) if bi == b and not a <= i < e]
        for dst, src in zip(holes, strays):
            order[dst] = src
    return order


def _decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, segments, masks) -> torch.Tensor:
    """Attention of one query per row ([b, heads, head_dim]) over the cache rows 0..b-1, range by range,
    each over its own span (slices of the cache); returns [b, heads x head_dim]. The query heads that share
    a KV head (heads h*g .. h*g+g-1 read KV head h) attend as that head's g queries: no KV head is repeated."""
    b, kv_heads = q.shape[0], kc.shape[1]
    qd = q.view(b, kv_heads, q.shape[1] // kv_heads, q.shape[2])
    if len(segments) == 1:
        span = segments[0][2]
        out = F.scaled_dot_product_attention(qd, kc[:b, :, :span], vc[:b, :, :span], attn_mask=masks[0])
    else:
        out = torch.empty_like(qd)
        for (a, e, span), mask in zip(segments, masks):
            out[a:e] = F.scaled_dot_product_attention(qd[a:e], kc[a:e, :, :span], vc[a:e, :, :span], attn_mask=mask)
    return out.reshape(b, -1)


GPU_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels a GPU runner may use: every one but cuDNN's, which plans each new shape."""


class ModelRunner:
    def __init__(self, model, num_slots: int, max_model_len: int):
        """`num_slots`: the running batch's slots first, then any slots that park aborted sequences. The
        runner works on the model's device (CPU here; the HTTP server also serves it from a GPU)."""
        cfg = model.config
        if cfg.hidden_act != "silu":
            raise ValueError(f"model config hidden_act={cfg.hidden_act!r}: the CPU engine runs Qwen3's SiLU MLP only")
        self.model = model
        self.layers = model.model.layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_model_len = max_model_len
        param = next(model.parameters())  # the model's device and dtype are the cache's and the inputs'
        self.dtype, self.device = param.dtype, param.device
        self.attention_kernels = (lambda: sdpa_kernel(GPU_ATTENTION)) if self.device.type == "cuda" else nullcontext
        self.cache_shape = (len(self.layers), num_slots, self.num_kv_heads, max_model_len, self.head_dim)
        self.allocate_cache()
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(self.device)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def allocate_cache(self) -> None:
        self.k_cache = torch.zeros(self.cache_shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(self.cache_shape, dtype=self.dtype, device=self.device)

    def free_cache(self) -> None:
        """Give the KV cache's memory back (a colocated learner trains meanwhile); `allocate_cache` makes a
        new, empty one."""
        self.k_cache = self.v_cache = None

    @property
    def has_cache(self) -> bool:
        return self.k_cache is not None

    def _qkv(self, attn, h: torch.Tensor, cos, sin):
        """Queries, keys, values of a flat batch of tokens [T, hidden] -> [T, heads, head_dim], rotated."""
        t = h.shape[0]
        q = _rms(attn.q_norm, _linear(attn.q_proj, h).view(t, self.num_heads, self.head_dim))
        k = _rms(attn.k_norm, _linear(attn.k_proj, h).view(t, self.num_kv_heads, self.head_dim))
        v = _linear(attn.v_proj, h).view(t, self.num_kv_heads, self.head_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _block(self, layer, x, attend):
        x = x + _linear(layer.self_attn.o_proj, attend(layer.self_attn, _rms(layer.input_layernorm, x)))
        mlp, h = layer.mlp, _rms(layer.post_attention_layernorm, x)
        return x + _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, h)) * _linear(mlp.up_proj, h))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.model.lm_head, _rms(self.model.model.norm, x)).float()

    @torch.inference_mode()
    def forward(self, last_tokens: list[int], positions: list[int], segments: list[tuple[int, int, int]],
                token_lists: list[list[int]] = (), slots: list[int] = ()) -> torch.Tensor:
        """One pass over a mixed batch: one token for each running sequence i in slot i (`last_tokens` at
        `positions`, attending in `segments`, `decode_segments(positions)`: contiguous row ranges, each
        over its own span, slices of the cache and never a gathered copy), and whole inputs
        (`token_lists`, right-padded) into the cache `slots`. Logits [decode rows + inputs, V]: each
        decode row's, then each input's at its last position.

        Prefilling in the decode step's pass, as SGLang's mixed batches do, shares every projection,
        norm and MLP op between the two: at this size a separate prefill pass for a few fresh prompts
        costs about half a 64-row decode step."""
        b, n, dev = len(last_tokens), len(token_lists), self.device
        ids, pos = [torch.tensor(last_tokens, dtype=torch.long)], [torch.tensor(positions, dtype=torch.long)]
        if n:
            lens = torch.tensor([len(t) for t in token_lists])
            width = int(lens.max())
            padded = torch.zeros(n, width, dtype=torch.long)
            for row, toks in enumerate(token_lists):
                padded[row, : len(toks)] = torch.tensor(toks)
            ids.append(padded.view(-1))
            pos.append(torch.arange(width).repeat(n))
            slot_idx, lens = torch.tensor(slots, device=dev), lens.to(dev)
        flat_pos = torch.cat(pos).to(dev)
        cos, sin = self.cos[flat_pos][:, None, :], self.sin[flat_pos][:, None, :]
        dpos, rows = flat_pos[:b], torch.arange(b, device=dev)
        # Additive masks, built once a pass (a boolean one is converted inside every attention call).
        masks = [torch.zeros(e - a, 1, 1, span, dtype=self.k_cache.dtype, device=dev)
                 .masked_fill_(torch.arange(span, device=dev) > dpos[a:e, None, None, None], float("-inf"))
                 for a, e, span in segments]

        def attend(layer_idx):
            def fn(attn, h):
                q, k, v = self._qkv(attn, h, cos, sin)
                kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]
                outs = []
                if b:
                    kc[rows, :, dpos], vc[rows, :, dpos] = k[:b], v[:b]
                    outs.append(_decode_attention(q[:b], kc, vc, segments, masks))
                if n:
                    qp, kp, vp = (t[b:].view(n, width, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
                    kc[slot_idx, :, :width], vc[slot_idx, :, :width] = kp, vp
                    # Padding sits after each real token, so the causal mask already hides it.
                    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
                    outs.append(op.transpose(1, 2).reshape(n * width, -1))
                return torch.cat(outs) if len(outs) > 1 else outs[0]
            return fn

        x = self.model.model.embed_tokens(torch.cat(ids).to(dev))
        with self.attention_kernels():
            for i, layer in enumerate(self.layers):
                x = self._block(layer, x, attend(i))
        if n:
            x = x[torch.cat([rows, b + torch.arange(n, device=dev) * width + lens - 1])]
        return self._logits(x)

    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Row dst[i] of the cache becomes the old row src[i] (its first `length` positions); the rows are
        read before any is written, so src and dst may overlap (a permutation of some rows)."""
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.k_cache[:, d, :, :length] = self.k_cache[:, s, :, :length]
        self.v_cache[:, d, :, :length] = self.v_cache[:, s, :, :length]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of one slot into another (park, restore, repack)."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, logprobs under softmax(logits / temperature), ok). A row
    whose distribution is not finite (`ok` false) gets token 0: one bad request must not stop the batch."""
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
    probs = filtered.softmax(-1)
    ok = torch.isfinite(probs).all(-1) & torch.isfinite(logp).any(-1)
    probs = torch.where(ok[:, None], probs, 1.0)  # multinomial raises on any bad row
    sampled = torch.multinomial(probs, 1, generator=generator)[:, 0]
    tokens = torch.where(ok, torch.where(greedy, logits.argmax(-1), sampled), 0)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0], ok
