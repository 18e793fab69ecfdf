"""A GPT-2 written by hand in PyTorch: the model every stage of this project trains, and ``generate``.

The architecture is GPT-2's (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"):
token + learned position embeddings, ``n_layers`` pre-LayerNorm Transformer blocks (causal multi-head attention
and a 4x GELU feed-forward, each inside a residual connection), a final LayerNorm and a linear head over the
vocabulary. Names follow the walkthrough in ``notes/gpt_model.md`` (``W_query``, ``out_proj``, ``trf_blocks`` ...),
so the weights of OpenAI's GPT-2 and of uer/gpt2-chinese-cluecorpussmall map one to one (see ``load_weight.py``).

Shapes in comments: B batch, T tokens, E ``emb_dim``, V vocabulary, H heads, d_h = E / H head dimension.

Options beyond GPT-2, off by default: RMSNorm instead of LayerNorm (Zhang & Sennrich 2019) and rotary position
embeddings (Su et al. 2021, "RoFormer") instead of the learned position table.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters. The first seven fields are the seed walkthrough's ``cfg`` keys."""

    vocab_size: int = 21128  # bert-base-chinese vocabulary
    context_length: int = 256  # rows of the position table: the longest sequence the model can read
    emb_dim: int = 256
    n_heads: int = 4
    n_layers: int = 4
    drop_rate: float = 0.1
    qkv_bias: bool = False  # GPT-2 and uer checkpoints have q/k/v biases; training from scratch does not need them
    tie_embeddings: bool = True  # the output head reuses the token embedding matrix (as GPT-2 does)
    layer_norm_eps: float = 1e-5
    norm: str = "layernorm"  # or "rmsnorm"
    position_embedding: str = "learned"  # or "rope"
    attention: str = "sdpa"  # fused torch kernel; "math" runs the explicit softmax(QK^T/sqrt(d_h))V reference
    # the token every training document started with, which a prompt to continue must start with too: uer's Chinese
    # GPT-2 was trained on "[CLS] text [SEP]" (101); our own pretraining joins documents with [SEP] alone (None)
    bos_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.emb_dim % self.n_heads != 0:
            raise ValueError(f"emb_dim={self.emb_dim} must be divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.position_embedding not in ("learned", "rope"):
            raise ValueError(f"position_embedding must be 'learned' or 'rope', got {self.position_embedding!r}")
        if self.position_embedding == "rope" and (self.emb_dim // self.n_heads) % 2:
            raise ValueError("rope needs an even head dimension (emb_dim / n_heads)")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"attention must be 'sdpa' or 'math', got {self.attention!r}")
        if self.bos_id is not None and not 0 <= self.bos_id < self.vocab_size:
            raise ValueError(f"bos_id must be a token id in 0..{self.vocab_size - 1} or None, got {self.bos_id}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        """Build from a dict (e.g. a checkpoint's config.json); unknown keys raise ``ValueError``."""
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {sorted(unknown)}")
        return cls(**d)

    def replace(self, **changes) -> GPTConfig:
        return replace(self, **changes)


# Named sizes. "demo" trains in minutes on 2 CPU cores; "gpt2-zh-small" is the seed's 12x768 model with a 256
# context; "uer-gpt2-chinese" is the shape of uer/gpt2-chinese-cluecorpussmall (load its weights with load_weight.py).
PRESETS = {
    "tiny": GPTConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0),  # tests
    # < 1 epoch: no dropout; rotary positions learn faster than a position table (bench/README.md: the sweep)
    "demo": GPTConfig(context_length=256, emb_dim=256, n_heads=4, n_layers=4, drop_rate=0.0,
                      position_embedding="rope"),
    "gpt2-zh-small": GPTConfig(context_length=256, emb_dim=768, n_heads=12, n_layers=12, drop_rate=0.1,
                               tie_embeddings=False),
    "uer-gpt2-chinese": GPTConfig(context_length=1024, emb_dim=768, n_heads=12, n_layers=12, drop_rate=0.1,
                                  qkv_bias=True),
}


def get_preset(name: str) -> GPTConfig:
    """The ``GPTConfig`` of a named preset. Raises ``ValueError`` naming the choices."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


class LayerNorm(nn.Module):
    """Layer normalisation over the last dimension with a learned ``scale`` and ``shift`` (Ba et al. 2016).

    Uses the biased variance (divide by E), as GPT-2 does. ``forward`` runs PyTorch's fused kernel;
    ``reference`` is the same formula written out, kept for the notes and the tests.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):  # (..., E) -> (..., E)
        return F.layer_norm(x, self.scale.shape, self.scale, self.shift, self.eps)

    def reference(self, x):
        mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # (..., 1)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)  # (..., E)
        return self.scale * norm_x + self.shift


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang & Sennrich 2019): no mean subtraction, a learned ``scale`` only."""

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x):  # (..., E) -> (..., E)
        rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return self.scale * (x / rms)


class GELU(nn.Module):
    """GELU with GPT-2's tanh approximation (Hendrycks & Gimpel 2016): 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))."""

    def forward(self, x):
        return F.gelu(x, approximate="tanh")  # the fused kernel of ``reference``

    @staticmethod
    def reference(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


# Products of at most this many rows (a decoding step's batch) take ``Linear``'s split path; more rows than this
# run F.linear as one BLAS call (bench/README.md: "Decoding against the memory bound", measured at 1 to 64 rows).
SPLIT_ROWS = 32


class Linear(nn.Linear):
    """``nn.Linear`` (y = x W^T + b, W of shape (out, in)), with one more path for decoding on a CPU.

    A decoding step multiplies a handful of rows by every weight matrix, so its time is the time to read the
    weights. One BLAS call for so few rows is a matrix-vector product, which MKL runs on a single thread on AMD
    CPUs, 2-4x slower than the memory bound (bench/README.md). So at inference (autograd off) in float32 on the CPU,
    with at most ``SPLIT_ROWS`` rows, the output features are cut into one block per thread and the blocks are
    multiplied in one batched product (``torch.bmm``), which BLAS spreads over the threads. The blocks are views
    of the weight: no copy, no extra memory. One row is computed as W x^T (the layout that reads fastest for a
    single vector), several as x W^T. Training, autocast, bf16 weights and GPUs always run ``F.linear``; the two
    paths agree up to float32 rounding.
    """

    def forward(self, x):  # (..., in) -> (..., out)
        # the checks that training and compiled code fail come first: torch.compile must not see the thread count
        if (not torch.is_grad_enabled() and x.device.type == "cpu" and not torch.compiler.is_compiling()
                and x.dtype == self.weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
                and x.numel() <= SPLIT_ROWS * self.in_features):
            parts = torch.get_num_threads()
            if parts > 1 and self.out_features % parts == 0:
                return self.split_forward(x, parts)
        return F.linear(x, self.weight, self.bias)

    def split_forward(self, x, parts: int):
        """``F.linear(x, weight, bias)`` as ``parts`` blocks of output features in one ``torch.bmm``."""
        rows = x.reshape(-1, self.in_features)  # (N, in)
        blocks = self.weight.view(parts, -1, self.in_features)  # (P, out/P, in), a view
        if rows.shape[0] == 1:
            y = torch.bmm(blocks, rows.t().expand(parts, -1, -1)).view(1, -1)  # (P, out/P, 1) -> (1, out)
        else:
            y = torch.bmm(rows.expand(parts, -1, -1), blocks.transpose(1, 2))  # (P, N, out/P)
            y = y.transpose(0, 1).reshape(rows.shape[0], -1)  # (N, out)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)


class FeedForward(nn.Module):
    """Position-wise MLP: E -> 4E -> GELU -> E."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            Linear(cfg.emb_dim, 4 * cfg.emb_dim),
            GELU(),
            Linear(4 * cfg.emb_dim, cfg.emb_dim),
        )

    def forward(self, x):  # (B, T, E) -> (B, T, 4E) -> (B, T, E)
        return self.layers(x)


def attention_reference(queries, keys, values, visible=None, dropout=None):
    """Scaled dot-product attention written out: softmax(Q K^T / sqrt(d_h) + mask) V (Vaswani et al. 2017).

    Args:
        queries: (B, H, Tq, d_h); keys, values: (B, H, Tk, d_h).
        visible: optional mask broadcastable to (B, H, Tq, Tk): a bool tensor (True = may attend) or an additive
            float tensor (0 or -inf, or any bias). None means every key is visible.
    Returns:
        (B, H, Tq, d_h). A query row with no visible key returns zeros instead of NaN.
    """
    scores = queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])  # (B, H, Tq, Tk)
    if visible is not None:
        if visible.dtype == torch.bool:
            scores = scores.masked_fill(~visible, float("-inf"))
        else:
            scores = scores + visible
    fully_masked = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, Tq, 1)
    weights = torch.softmax(scores.masked_fill(fully_masked, 0.0), dim=-1)
    weights = weights.masked_fill(fully_masked, 0.0)  # softmax of an all -inf row would be NaN
    if dropout is not None:
        weights = dropout(weights)
    return weights @ values  # (B, H, Tq, d_h)


def rope_angles(head_dim: int, positions, base: float = 10000.0):
    """The rotations of RoPE for integer positions m (Su et al. 2021): e^{i theta_j m} = cos(theta_j m) +
    i sin(theta_j m), theta_j = base^(-2j / d_h), one per pair of dimensions.

    positions: (B, T) long -> (B, 1, T, d_h / 2) complex64, broadcastable over heads.
    """
    theta = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None, :, None] * theta  # (B, 1, T, d_h/2)
    return torch.complex(angles.cos(), angles.sin())  # (B, 1, T, d_h/2)


def apply_rope(x, rotation):
    """Rotate each adjacent pair of dimensions (2i, 2i+1) of x: (B, H, T, d_h) by its position's angle.

    A pair read as the complex number x_2i + i x_2i+1, times e^{i angle}, is the 2-D rotation
    (x_2i cos - x_2i+1 sin, x_2i sin + x_2i+1 cos): one complex multiply instead of the ten real operations
    written out (the same up to float32 rounding, 6x faster forward and backward at the demo's training shapes,
    bench/README.md). ``rotation``: (B, 1, T, d_h / 2) from ``rope_angles``. Computed in float32; under
    ``torch.compile`` the complex multiply runs as an eager kernel.
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, H, T, d_h/2) complex
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)  # (B, H, T, d_h)


class KVCache:
    """Keys and values of every layer for the tokens seen so far, preallocated to ``max_len`` positions.

    Each decoding step writes its new keys/values in place instead of concatenating, so a step's cost does not
    grow with the copies of earlier steps. ``length`` is the number of positions filled.
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, max_len: int):
        self.shape = (cfg.n_layers, batch_size, cfg.n_heads, max_len, cfg.emb_dim // cfg.n_heads)
        self.keys = self.values = None  # (L, B, H, max_len, d_h), allocated on first use in the keys' dtype
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.shape[3]

    def repeat_interleave(self, k: int) -> None:
        """Each row's cache k times over, in place: row b becomes rows b*k .. b*k+k-1 (several continuations of one
        prompt share its keys and values)."""
        self.shape = (self.shape[0], self.shape[1] * k, *self.shape[2:])
        if self.keys is not None:
            self.keys = self.keys.repeat_interleave(k, dim=1)
            self.values = self.values.repeat_interleave(k, dim=1)

    def keep_rows(self, rows) -> None:
        """Keep only the batch rows ``rows`` (a (b,) LongTensor of indices), in place: rows whose generation has
        finished stop costing compute in later steps."""
        self.shape = (self.shape[0], len(rows), *self.shape[2:])
        if self.keys is not None:
            self.keys = self.keys[:, rows]
            self.values = self.values[:, rows]

    def update(self, layer: int, keys, values):
        """Store (B, H, T, d_h) new keys/values after the cached ones; return all of them, (B, H, length+T, d_h)."""
        start, end = self.length, self.length + keys.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot add {keys.shape[2]} after {start}")
        if self.keys is None:  # under autocast the projections may be bf16: store what they produce
            # empty, not zeros: only filled positions are ever read, and zeroing a large cache costs page faults
            self.keys = torch.empty(self.shape, device=keys.device, dtype=keys.dtype)
            self.values = torch.empty(self.shape, device=keys.device, dtype=keys.dtype)
        self.keys[layer, :, :, start:end] = keys
        self.values[layer, :, :, start:end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with separate query/key/value projections (the seed's names).

    Configured from a ``GPTConfig`` like every other block: ``emb_dim`` in and out, ``n_heads`` heads of
    ``emb_dim // n_heads``, ``qkv_bias``, ``drop_rate`` on the attention weights, ``attention`` ("sdpa" for
    PyTorch's fused kernel, "math" for the written-out ``attention_reference``) and rotary positions when
    ``position_embedding == "rope"``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.emb_dim % cfg.n_heads == 0, "emb_dim must be divisible by n_heads"
        self.d_out = cfg.emb_dim
        self.num_heads = cfg.n_heads
        self.head_dim = cfg.emb_dim // cfg.n_heads
        self.W_query = Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.W_key = Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.W_value = Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.out_proj = Linear(cfg.emb_dim, cfg.emb_dim)
        self.dropout = nn.Dropout(cfg.drop_rate)
        self.use_sdpa = cfg.attention == "sdpa"
        self.use_rope = cfg.position_embedding == "rope"

    def forward(self, x, visible=None, rope=None, cache: KVCache | None = None, layer: int = 0):
        """Attend from each position of x to itself and the positions before it.

        Args:
            x: (B, T, E) hidden states of the new tokens.
            visible: None for a plain causal pass, else a bool mask (B, 1, T, Tk) where True means "may attend";
                Tk counts cached positions plus the T new ones.
            rope: the rotations (B, 1, T, d_h/2) of the new positions (``rope_angles``) when rotary embeddings
                are on.
            cache: keys/values of earlier positions; the new ones are written into it.
        Returns:
            (B, T, E).
        """
        b, num_tokens, _ = x.shape  # (B, T, E)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)
        if self.use_rope:
            queries, keys = apply_rope(queries, rope), apply_rope(keys, rope)
        if cache is not None:
            keys, values = cache.update(layer, keys, values)  # (B, H, Tk, d_h)

        causal_only = visible is None and keys.shape[2] == num_tokens
        if visible is None and num_tokens > 1 and not causal_only:
            # several new tokens after cached ones, no padding: causal among the new, all cached keys visible
            visible = causal_mask(num_tokens, keys.shape[2], x.device)
        if self.use_sdpa:
            context = fused_attention(queries, keys, values, visible, causal_only,
                                      self.dropout.p if self.training else 0.0)  # (B, H, T, d_h)
        else:
            if causal_only:
                visible = causal_mask(num_tokens, num_tokens, x.device)
            context = attention_reference(queries, keys, values, visible, self.dropout)  # (B, H, T, d_h)
        context = context.transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (B, T, E)
        return self.out_proj(context)  # (B, T, E)


def fused_attention(queries, keys, values, visible=None, is_causal: bool = False, dropout_p: float = 0.0):
    """``F.scaled_dot_product_attention`` (PyTorch's fused kernels), computed in fp32 on the CPU when autocast has
    made q, k, v bf16. PyTorch's CPU flash-attention kernel is 3-4x slower in bf16 than in fp32 at the demo's
    shapes, forward and backward (``bench/bench_attention.py``), so the upcast makes bf16 training faster and the
    softmax more exact; GPUs keep their bf16 kernels.

    Args as ``attention_reference`` (``visible``: bool, True = may attend) plus ``is_causal`` for a plain causal
    pass without a mask. Returns (B, H, Tq, d_h) in the dtype of ``queries``.
    """
    if queries.device.type == "cpu" and queries.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            context = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(), attn_mask=visible,
                                                     is_causal=is_causal, dropout_p=dropout_p)
        return context.to(queries.dtype)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, is_causal=is_causal,
                                          dropout_p=dropout_p)


def causal_mask(num_queries: int, num_keys: int, device=None):
    """Bool (Tq, Tk): query i (the i-th of the last Tq positions) may attend key j iff j <= i + (Tk - Tq)."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(diagonal=num_keys - num_queries)


class TransformerBlock(nn.Module):
    """Pre-LN block: x + Dropout(Attention(Norm(x))), then x + Dropout(FeedForward(Norm(x)))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.att = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        norm = RMSNorm if cfg.norm == "rmsnorm" else LayerNorm
        self.norm1 = norm(cfg.emb_dim, cfg.layer_norm_eps)
        self.norm2 = norm(cfg.emb_dim, cfg.layer_norm_eps)
        self.drop_resid = nn.Dropout(cfg.drop_rate)

    def forward(self, x, visible=None, rope=None, cache=None, layer=0):  # (B, T, E) -> (B, T, E)
        x = x + self.drop_resid(self.att(self.norm1(x), visible, rope, cache, layer))  # (B, T, E)
        x = x + self.drop_resid(self.ff(self.norm2(x)))  # (B, T, E)
        return x


class GPTModel(nn.Module):
    """The GPT-2 language model.

    ``forward(input_ids, attention_mask=None, past_key_values=None, use_cache=False)`` returns a dict with
    ``"logits"`` (B, T, V) and ``"last_hidden_state"`` (B, T, E), plus ``"past_key_values"`` (a ``KVCache``) when
    ``use_cache`` is set. Given ``labels`` (B, T), already shifted as in ``next_token_loss``, it returns
    ``"loss"`` (the mean next-token cross-entropy, from ``chunked_next_token_loss``) instead of ``"logits"``.

    ``attention_mask`` (B, T_past + T) marks real tokens with 1 and padding with 0, left or right. Positions are
    counted from each row's first real token, so a padded row gives the same outputs at its real positions as the
    same sequence alone.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim) if cfg.position_embedding == "learned" else None
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = (RMSNorm if cfg.norm == "rmsnorm" else LayerNorm)(cfg.emb_dim, cfg.layer_norm_eps)
        self.out_head = Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("layers.2.weight"):
                # GPT-2: scale the residual-branch outputs by 1/sqrt(2 * n_layers) so the sum stays O(1)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))
        if cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden_states(self, input_ids, attention_mask=None, past_key_values: KVCache | None = None,
                      use_cache: bool = False):
        """Everything but the output head: (B, T) ids -> ((B, T, E) final-normed states, cache or None).

        Raises ``ValueError`` when positions would run past ``context_length``.
        """
        batch_size, seq_len = input_ids.shape  # (B, T)
        past_len = past_key_values.length if past_key_values is not None else 0
        if attention_mask is not None and attention_mask.shape != (batch_size, past_len + seq_len):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                             f"{(batch_size, past_len + seq_len)} (cached + new tokens)")
        if attention_mask is None or bool(attention_mask.all()):
            positions = torch.arange(past_len, past_len + seq_len, device=input_ids.device).expand(batch_size, -1)
            visible = None  # plain causal attention: the fused kernel's fastest path
            last_position = past_len + seq_len - 1  # known without reading the tensor back
        else:
            mask = attention_mask.bool()
            positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, past_len:]  # (B, T)
            visible = causal_mask(seq_len, past_len + seq_len, input_ids.device)[None] & mask[:, None, :]
            # a padding query sees no real key; let it see itself so no softmax row is empty (its output is unused)
            own = torch.zeros_like(visible)
            own[:, torch.arange(seq_len), torch.arange(past_len, past_len + seq_len)] = True
            visible = (visible | own)[:, None]  # (B, 1, T, T_past + T)
            last_position = int(positions.max())
        if last_position >= self.cfg.context_length:
            raise ValueError(f"position {last_position} is past the model's context_length "
                             f"{self.cfg.context_length}; keep at most the last {self.cfg.context_length} tokens")

        x = self.tok_emb(input_ids)  # (B, T, E)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)  # (B, T, E)
        else:
            rope = rope_angles(self.cfg.emb_dim // self.cfg.n_heads, positions)
        x = self.drop_emb(x)  # (B, T, E)

        cache = past_key_values
        if use_cache and cache is None:
            cache = KVCache(self.cfg, batch_size, self.cfg.context_length)
        for layer, block in enumerate(self.trf_blocks):
            x = block(x, visible, rope, cache, layer)  # (B, T, E)
        if cache is not None:
            cache.length += seq_len
        return self.final_norm(x), cache  # (B, T, E)

    def forward(self, input_ids, attention_mask=None, past_key_values: KVCache | None = None, use_cache=False,
                labels=None, logits_to_keep: int = 0):
        """(B, T) ids -> {"logits": (B, T, V), "last_hidden_state": (B, T, E)}; with ``labels`` (B, T) "loss"
        replaces "logits"; with ``use_cache`` "past_key_values" is added; with ``logits_to_keep`` k > 0 the logits
        are those of the last k positions only, (B, k, V) (``transformers``' name: the head is the costliest layer
        of a small model, and a prompt's prefill needs its last position's alone). See the class docstring."""
        last_hidden_state, cache = self.hidden_states(input_ids, attention_mask, past_key_values, use_cache)
        out = {"last_hidden_state": last_hidden_state}
        if labels is None:
            kept = last_hidden_state[:, -logits_to_keep:] if logits_to_keep else last_hidden_state
            out["logits"] = self.out_head(kept)  # (B, T, V), or (B, k, V)
        else:  # the loss straight from the hidden states: the (B, T, V) logits are never stored
            out["loss"] = chunked_next_token_loss(last_hidden_state, self.out_head.weight, labels)
        if use_cache:
            out["past_key_values"] = cache
        return out


def next_token_loss(logits, labels):
    """Mean cross-entropy of ``logits`` (B, T, V) against ``labels`` (B, T), already shifted so that
    ``labels[:, t]`` is the token that should follow position t; label -100 is ignored. Computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def chunked_next_token_loss(hidden, weight, labels, chunk_rows: int | None = None):
    """``next_token_loss(hidden @ weight.T, labels)`` without ever holding the (N, V) logits.

    Args:
        hidden: (B, T, E) final-normed hidden states (``last_hidden_state``).
        weight: (V, E) output head weight (``out_head.weight``).
        labels: (B, T) next-token ids, already shifted; -100 is ignored.
        chunk_rows: at most this many rows of logits at a time (default: about 8M logits, 32 MB in float32, per
            chunk on a CPU, where a chunk should stay in cache; 128M logits, 512 MB, on a GPU, where larger chunks
            make larger matrix products and fewer kernel launches); the rows are split into equal chunks.
    Returns:
        the mean cross-entropy over the labels that are not -100, a float32 scalar (NaN if there are none, as
        ``F.cross_entropy`` gives).
    Raises:
        ValueError: ``labels`` not of shape (B, T) (e.g. ``input_ids[:, 1:]``, one short: pad it with -100).

    Rows whose label is -100 (SFT prompts, padding) never go through the head. With gradients on, each chunk's
    softmax becomes its gradient right away (d loss / d logits = softmax - one_hot) and is multiplied into the
    gradients of ``hidden`` and ``weight`` before the next chunk, so the backward pass only rescales them. This
    is the fused linear cross-entropy of Liger Kernel (Hsu et al. 2024) and of "Cut Your Losses in
    Large-Vocabulary Language Models" (Wijmans et al. 2024), in plain PyTorch. Under autocast the matmuls run
    in the autocast dtype and the softmax in float32, as ``out_head`` + ``next_token_loss`` would. The
    gradient cannot be differentiated again (no double backward).
    """
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but the hidden states {tuple(hidden.shape[:-1])}: "
                         f"give one label per input position, already shifted (-100 where nothing is predicted)")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, E), (N,)
    rows = (flat_labels != -100).nonzero().squeeze(1)  # (n,) the positions that count
    chunk_rows = chunk_rows or max(1, (1 << (27 if hidden.is_cuda else 23)) // weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, flat_labels, rows, chunk_rows)
    return _chunked_head_loss(flat_hidden, weight, flat_labels, rows, chunk_rows, with_grads=False)[0]


def _chunked_head_loss(flat_hidden, weight, flat_labels, rows, chunk_rows, with_grads):
    """The chunk loop of ``chunked_next_token_loss``: (mean loss, grad of hidden (N, E) or None, grad of weight
    (V, E) or None), the gradients of the mean loss."""
    device = flat_hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    count = rows.numel()
    total = torch.zeros((), dtype=torch.float32, device=flat_hidden.device)
    grad_hidden = torch.zeros_like(flat_hidden) if with_grads else None  # (N, E)
    sum_dtype = torch.promote_types(weight.dtype, torch.float32)  # bf16 weights still sum their gradient in fp32
    grad_weight = torch.zeros(weight.shape, dtype=sum_dtype, device=weight.device) if with_grads else None
    num_chunks = -(-count // chunk_rows)
    chunk_rows = max(1, -(-count // max(num_chunks, 1)))  # equal chunks: a small last one would waste a pass over w
    fused = fused_softmax_cross_entropy() if flat_hidden.is_cuda else None
    scale = torch.tensor(1.0 / max(count, 1), device=flat_hidden.device) if with_grads else None
    with torch.autocast(device, enabled=False):
        w = weight.to(dtype)  # (V, E) one cast for all chunks
        for start in range(0, count, chunk_rows):
            at = rows[start:start + chunk_rows]  # (c,)
            h = flat_hidden[at].to(dtype)  # (c, E)
            y = flat_labels[at][:, None]  # (c, 1)
            logits = h @ w.t()  # (c, V) in the matmul dtype
            if fused is not None:  # a GPU: two passes over the logits in fused kernels instead of eight
                loss, grad = fused(logits, y, scale)  # grad: d mean / d logits, (c, V) in dtype
                total += loss
            else:  # the CPU: the same steps, in place on one float32 chunk that stays in cache
                logits = logits.float()  # (c, V)
                picked = logits.gather(1, y)  # (c, 1)
                peak = logits.amax(dim=1, keepdim=True)  # (c, 1)
                probs = logits.sub_(peak).exp_()  # (c, V) unnormalised softmax, in place of the logits
                norm = probs.sum(dim=1, keepdim=True)  # (c, 1)
                total += (peak + norm.log() - picked).sum()  # log-sum-exp minus the label's logit
                if with_grads:
                    # d mean / d logits = (softmax - one_hot) / count
                    probs.mul_(1.0 / (norm * count)).scatter_add_(1, y, torch.full_like(probs[:, :1], -1.0 / count))
                    grad = probs.to(dtype)  # (c, V)
            if with_grads:
                grad_hidden[at] = (grad @ w).to(grad_hidden.dtype)  # (c, E)
                if dtype == sum_dtype:
                    grad_weight.addmm_(grad.t(), h)  # (V, E)
                else:
                    grad_weight += grad.t() @ h  # (V, E) each chunk's bf16 product summed in float32
    mean = total / count if count else total * float("nan")
    return mean, grad_hidden, grad_weight


def softmax_cross_entropy(logits, labels, scale=None):
    """The sum over rows of the cross-entropy of ``logits`` (c, V) against ``labels`` (c, 1), in float32; with
    ``scale`` (a 0-d tensor) also ``scale * (softmax - one_hot)``, the gradient of ``scale * sum`` with respect to
    the logits, (c, V) in the logits' dtype (else None).

    Written to be compiled (``fused_softmax_cross_entropy``): Inductor turns it into one kernel that reads the
    logits once for each row's maximum and sum of exponentials, and one that reads them again and writes the
    gradient, where the eager operations make eight passes over a float32 copy.
    """
    x = logits.float()  # (c, V)
    peak = x.amax(dim=1, keepdim=True)  # (c, 1)
    norm = (x - peak).exp().sum(dim=1, keepdim=True)  # (c, 1)
    loss = (peak + norm.log() - x.gather(1, labels)).sum()  # log-sum-exp minus the label's logit
    if scale is None:
        return loss, None
    hit = torch.arange(x.shape[1], device=x.device) == labels  # (c, V) the labels' one-hot
    grad = ((x - peak).exp() / norm - hit.float()) * scale  # (c, V)
    return loss, grad.to(logits.dtype)


@functools.cache
def fused_softmax_cross_entropy():
    """``softmax_cross_entropy`` compiled by ``torch.compile`` (once per process, for any number of rows), where
    Triton can build GPU kernels; else the function itself. Used by ``chunked_next_token_loss`` on a GPU, where the
    passes over (c, V) logits, not the matrix products, were its cost (bench/README.md)."""
    from torch.utils._triton import has_triton

    return torch.compile(softmax_cross_entropy, dynamic=True) if has_triton() else softmax_cross_entropy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Autograd wrapper of ``_chunked_head_loss``: the gradients are computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, flat_hidden, weight, flat_labels, rows, chunk_rows):
        mean, grad_hidden, grad_weight = _chunked_head_loss(flat_hidden, weight, flat_labels, rows, chunk_rows,
                                                            with_grads=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return mean

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_output.to(grad_hidden.dtype), (grad_weight * grad_output).to(ctx.weight_dtype),
                None, None, None)


class ScalarHead(nn.Module):
    """``Linear(emb_dim, 1)``: one number per position, for reward and value models. (B, T, E) -> (B, T)."""

    def __init__(self, emb_dim: int):
        super().__init__()
        self.linear = nn.Linear(emb_dim, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / math.sqrt(emb_dim + 1))
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden):
        return self.linear(hidden).squeeze(-1)


def last_real_index(attention_mask):
    """(B, T) 0/1 mask -> (B,) index of each row's last 1 (works for left and right padding)."""
    t = attention_mask.shape[1]
    return t - 1 - attention_mask.flip(dims=[1]).long().argmax(dim=1)


class RewardModel(nn.Module):
    """A ``GPTModel`` backbone with a ``ScalarHead`` on ``last_hidden_state``.

    As a reward model (InstructGPT, Ouyang et al. 2022) it scores a whole sequence by the head's value at the
    sequence's last real token; as a PPO critic the per-position ``values`` are the value estimates.
    ``forward(input_ids, attention_mask)`` -> {"values": (B, T), "rewards": (B,)}.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = GPTModel(cfg)
        self.head = ScalarHead(cfg.emb_dim)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden, _ = self.backbone.hidden_states(input_ids, attention_mask)  # (B, T, E)
        values = self.head(hidden)  # (B, T)
        rewards = values.gather(1, last_real_index(attention_mask)[:, None]).squeeze(1)  # (B,)
        return {"values": values, "rewards": rewards}


def filter_logits(logits, top_k=None, top_p=None):
    """Keep the ``top_k`` highest logits and/or the smallest set whose probability reaches ``top_p``
    (nucleus sampling, Holtzman et al. 2019); the rest become -inf. (B, V) -> (B, V).

    ``top_k`` larger than V is clamped to V; ``top_k`` < 1 or ``top_p`` outside (0, 1] raises ``ValueError``.
    """
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p is not None and top_p < 1.0:  # top_p == 1 keeps everything (a float32 cumsum may reach 1 early)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_from(probs):
    """One token per row drawn from (B, V) probabilities -> (B,) ids, by inverse-transform sampling: the first
    token whose cumulative probability reaches u ~ U(0, total). The same distribution as ``torch.multinomial``, at
    less than half its cost on a 21128-way softmax on the CPU; a zero-probability token is never drawn."""
    cdf = probs.cumsum(dim=-1)  # (B, V)
    u = (1.0 - torch.rand(probs.shape[0], 1, device=probs.device)) * cdf[:, -1:]  # (B, 1), in (0, total]
    return torch.searchsorted(cdf, u).squeeze(1).clamp(max=probs.shape[-1] - 1)  # (B,)


def apply_repetition_penalty(logits, idx, penalty: float):
    """Make tokens already in ``idx`` (B, T) less likely (Keskar et al. 2019, CTRL): a positive logit is divided by
    ``penalty``, a negative one multiplied. (B, V) -> (B, V)."""
    seen = torch.gather(logits, 1, idx)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, idx, seen)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper (which ``accelerate launch --dynamo_backend`` leaves on the
    prepared model), or ``model`` itself. Saving and generation use the real module: its state-dict names carry
    no ``_orig_mod.`` prefix, and it does not recompile for every new sequence length."""
    return getattr(model, "_orig_mod", model)


def fitted_context(model, context_size: int, eos_id: int | None) -> int:
    """``context_size`` clamped to the model's ``cfg.context_length`` (it has no positions past it: a longer window
    would fail once the text outgrows it).

    Raises:
        ValueError: ``context_size`` < 1, or an ``eos_id`` outside the model's vocabulary (it could never be
            sampled, so generation would never stop).
    """
    if context_size < 1:
        raise ValueError(f"context_size must be >= 1, got {context_size}")
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return context_size
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id {eos_id} is not a token of this model (vocabulary 0..{cfg.vocab_size - 1}); "
                         f"give the id of its end-of-text token, e.g. [SEP] = 102 for BERT-Chinese")
    return min(context_size, cfg.context_length)


def next_token(logits, idx, temperature: float, top_k=None, top_p=None, repetition_penalty: float = 1.0):
    """The next token of each row from its last-position ``logits`` (B, V): the ``repetition_penalty`` on the
    tokens of ``idx`` (B, T) so far, then greedy (``argmax``) when ``temperature == 0``, else a sample from
    softmax(logits / temperature) after ``top_k`` / ``top_p`` filtering, with torch's global RNG. In float32
    whatever the model's precision. Returns (B,) LongTensor."""
    logits = logits.float()
    if repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, idx, repetition_penalty)
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    if temperature != 1.0:  # at 1 the division would be a full pass over (B, V) that changes nothing
        logits = logits / temperature
    probs = torch.softmax(filter_logits(logits, top_k, top_p), dim=-1)  # (B, V)
    return sample_from(probs)  # (B,)


def generate(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, top_p=None, eos_id=None,
             attention_mask=None, repetition_penalty=1.0, stream=None, num_samples=1):
    """Continue each row of ``idx`` (B, T) by up to ``max_new_tokens`` tokens; returns (B, T + n) LongTensor.

    With ``num_samples`` k > 1 each row is continued k times: the prompt is read once and its cached keys and
    values copied k times, and the result is (B * k, T + n), the k continuations of row b in rows b*k .. b*k+k-1.

    Each token is chosen by ``next_token`` (greedy, or sampled with torch's global RNG: seed it for repeatable
    samples). Runs with the KV cache while the sequence fits in ``context_size`` positions (clamped to the model's
    own, ``fitted_context``); past that it slides a window over the last ``context_size`` tokens (recomputing the
    window each step, as the walkthrough's cache-less loop would). A longer prompt keeps its last tokens.

    Rows of different lengths go in one batch left-padded, with ``attention_mask`` (B, T) marking real tokens;
    each row gets what it would get alone. When ``eos_id`` is given, a row that emits it is finished and is
    filled with ``eos_id`` while the others go on (once a quarter of the rows computed have finished, they are
    dropped from the batch and the cache); the loop ends when all rows are finished. ``stream``, if
    given, is called with each new (B,) column of tokens; it may return a (B,) bool mask of rows to finish there
    as if they had emitted ``eos_id`` (a stop string was written, the reader left), or None. Dropout is off
    while generating (the model's train/eval mode is restored at the end).

    Raises:
        ValueError: an empty prompt, negative ``temperature``, ``num_samples`` < 1, ``repetition_penalty`` <= 0, bad
            ``top_k``/``top_p``, and what ``fitted_context`` refuses (``context_size`` < 1, an unknown ``eos_id``).
    """
    if idx.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. [CLS]) to continue from")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_new_tokens <= 0:  # nothing to generate: each row, k times over
        return idx.repeat_interleave(num_samples, 0)
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    model = unwrap_compiled(model)  # a compiled wrapper would recompile for every new length
    context_size = fitted_context(model, context_size, eos_id)
    # no_grad, not inference_mode: under CPU autocast that turns off the cache of bf16 weight copies (every step
    # would cast every weight again, bench/README.md), and PPO trains on these ids, which inference mode forbids
    with torch.no_grad():
        was_training = model.training
        model.eval()
        padded = attention_mask is not None and not bool(attention_mask.all())
        if not padded:
            attention_mask = None  # no padding: the model needs no mask, so no step builds, checks or extends one
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        cache, logits = None, None
        rows = None  # the rows the model still computes (None: all); finished ones are dropped as they pile up

        def live(t):
            return t if rows is None or t is None else t[rows]

        for _ in range(max_new_tokens):
            if logits is None:
                # a full pass over the last context_size tokens; keep its keys/values while later steps still fit
                window = live(idx)[:, -context_size:]
                window_mask = live(attention_mask)[:, -context_size:] if padded else None
                out = model(window, attention_mask=window_mask, use_cache=idx.shape[1] < context_size,
                            logits_to_keep=1)
                cache, logits = out.get("past_key_values"), out["logits"][:, -1, :]  # (B, V)
                if num_samples > 1:  # k continuations of each prompt from one reading of it
                    idx, logits, finished = (t.repeat_interleave(num_samples, 0) for t in (idx, logits, finished))
                    attention_mask = attention_mask.repeat_interleave(num_samples, 0) if padded else None
                    if cache is not None:
                        cache.repeat_interleave(num_samples)
                    num_samples = 1
            next_ids = next_token(logits, live(idx), temperature, top_k, top_p, repetition_penalty)  # (b,)
            if rows is not None:  # the dropped rows have finished: they get eos_id
                next_ids = torch.full_like(finished, eos_id, dtype=torch.long).index_copy(0, rows, next_ids)
            if eos_id is not None:
                next_ids = next_ids.masked_fill(finished, eos_id)  # (B,)
                finished |= next_ids == eos_id
            idx = torch.cat((idx, next_ids[:, None]), dim=1)  # (B, T + 1)
            if padded:
                attention_mask = torch.cat((attention_mask, torch.ones_like(attention_mask[:, :1])), dim=1)
            if stream is not None:
                stop = stream(next_ids)
                if stop is not None:  # rows the caller ends: later tokens of theirs are eos_id (or ignored)
                    finished |= torch.as_tensor(stop, dtype=torch.bool, device=finished.device)
            if bool(finished.all()):
                break
            running = ~live(finished)  # (b,)
            if eos_id is not None and 4 * int(running.sum()) <= 3 * running.numel():
                # a quarter of the computed rows have finished: drop them (each would cost a running row's step
                # for a token that is eos_id anyway). Sampled rows then draw other random numbers than before
                kept = running.nonzero().squeeze(1)  # (b',)
                rows = kept if rows is None else rows[kept]
                if cache is not None:
                    cache.keep_rows(kept)
            if cache is not None and idx.shape[1] <= context_size:
                # one new token against the cached keys/values: positions continue from the cache length
                out = model(live(next_ids)[:, None], attention_mask=live(attention_mask), past_key_values=cache,
                            use_cache=True)
                logits = out["logits"][:, -1, :]
            else:
                cache, logits = None, None  # past the context: the window slides, so positions must be recomputed
        model.train(was_training)
    return idx
