"""A GPT-2 written by hand in PyTorch: the model every stage of this project trains, and ``generate``.

The architecture is GPT-2's (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"):
token + learned position embeddings, ``n_layers`` pre-LayerNorm Transformer blocks (causal multi-head attention
and a 4x GELU feed-forward, each inside a residual connection), a final LayerNorm and a linear head over the
vocabulary. Names follow the walkthrough in ``notes/gpt_model.md`` (``W_query``, ``out_proj``, ``trf_blocks`` ...),
so the weights of OpenAI's GPT-2 and of uer/gpt2-chinese-cluecorpussmall map one to one (see ``load_weight.py``).

Shapes in comments: B batch, T tokens, E ``emb_dim``, V vocabulary, H heads, d_h = E / H head dimension.

Options beyond GPT-2, off by default: RMSNorm instead of LayerNorm (Zhang & Sennrich 2019) and rotary position
embeddings (Su et al. 2021, "RoFormer") instead of the learned position table. This file is the definition; the
speed work lives beside it in ``gpt_fast.py`` (``speed_up(model)``), tested equal to it.
"""

from __future__ import annotations

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
    """Layer normalisation over the last dimension with a learned ``scale`` and ``shift`` (Ba et al. 2016), with the
    biased variance (divide by E) as GPT-2. ``forward`` is PyTorch's fused kernel of ``reference``, written out."""

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


class FeedForward(nn.Module):
    """Position-wise MLP: E -> 4E -> GELU -> E."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),
            GELU(),
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),
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

    def update(self, layer: int, keys, values):
        """Store (B, H, T, d_h) new keys/values after the cached ones; return all of them, (B, H, length+T, d_h)."""
        start, end = self.length, self.length + keys.shape[2]
        if end > self.shape[3]:
            raise ValueError(f"KV cache holds {self.shape[3]} positions; cannot add {keys.shape[2]} after {start}")
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

    sdpa = staticmethod(F.scaled_dot_product_attention)  # PyTorch's fused kernels of ``attention_reference``

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.emb_dim % cfg.n_heads == 0, "emb_dim must be divisible by n_heads"
        self.d_out = cfg.emb_dim
        self.num_heads = cfg.n_heads
        self.head_dim = cfg.emb_dim // cfg.n_heads
        self.W_query = nn.Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.W_key = nn.Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.W_value = nn.Linear(cfg.emb_dim, cfg.emb_dim, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(cfg.emb_dim, cfg.emb_dim)
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
            context = self.sdpa(queries, keys, values, attn_mask=visible, is_causal=causal_only,
                                dropout_p=self.dropout.p if self.training else 0.0)  # (B, H, T, d_h)
        else:
            if causal_only:
                visible = causal_mask(num_tokens, num_tokens, x.device)
            context = attention_reference(queries, keys, values, visible, self.dropout)  # (B, H, T, d_h)
        context = context.transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (B, T, E)
        return self.out_proj(context)  # (B, T, E)


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
    ``"loss"`` (the mean next-token cross-entropy, ``loss``) instead of ``"logits"``.

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
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
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
        else:
            out["loss"] = self.loss(last_hidden_state, labels)
        if use_cache:
            out["past_key_values"] = cache
        return out

    def loss(self, last_hidden_state, labels):
        """``next_token_loss`` of the head's logits: (B, T, E), (B, T) -> a float32 scalar. (``gpt_fast.speed_up``
        computes the same without holding the (B, T, V) logits.)"""
        return next_token_loss(self.out_head(last_hidden_state), labels)  # (B, T, V) logits -> scalar


def next_token_loss(logits, labels):
    """Mean cross-entropy of ``logits`` (B, T, V) against ``labels`` (B, T), already shifted so that
    ``labels[:, t]`` is the token that should follow position t; label -100 is ignored: the mean over the counted
    positions of -log softmax(logits)[label]. Computed in float32; NaN when no label counts.

    Raises ``ValueError`` when ``labels`` is not (B, T) (``check_labels``)."""
    check_labels(labels, logits.shape[:-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def check_labels(labels, shape) -> None:
    """Refuse ``labels`` whose shape is not ``shape`` (B, T), one label per input position (``ValueError``)."""
    if labels.shape != shape:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but the hidden states {tuple(shape)}: "
                         f"give one label per input position, already shifted (-100 where nothing is predicted)")


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


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper (which ``accelerate launch --dynamo_backend`` leaves on the
    prepared model), or ``model`` itself. Saving and generation use the real module: its state-dict names carry
    no ``_orig_mod.`` prefix, and it does not recompile for every new sequence length."""
    return getattr(model, "_orig_mod", model)


def next_token(logits, temperature: float, top_k=None, top_p=None):
    """The next token of each row from its last-position ``logits`` (B, V): greedy (``argmax``) when
    ``temperature == 0``, else a sample from softmax(logits / temperature) after ``top_k`` / ``top_p`` filtering,
    with torch's global RNG. In float32 whatever the model's precision. Returns (B,) LongTensor."""
    logits = logits.float()
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    if temperature != 1.0:  # at 1 the division would be a full pass over (B, V) that changes nothing
        logits = logits / temperature
    probs = torch.softmax(filter_logits(logits, top_k, top_p), dim=-1)  # (B, V)
    return sample_from(probs)  # (B,)


def generate(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, top_p=None, eos_id=None,
             attention_mask=None):
    """Continue each row of ``idx`` (B, T) by up to ``max_new_tokens`` tokens; returns (B, T + n) LongTensor.

    Each token is chosen by ``next_token`` (greedy, or sampled with torch's global RNG: seed it for repeatable
    samples). The first step reads the prompt whole (the prefill) and keeps its keys and values in a ``KVCache``;
    each later step feeds one new token against them, while the sequence fits in ``context_size`` positions
    (clamped to the model's own). Past that the window slides over the last ``context_size``
    tokens, recomputed each step as the walkthrough's cache-less loop would (positions must start again from 0).

    Rows of different lengths go in one batch left-padded, with ``attention_mask`` (B, T) marking real tokens;
    each row gets what it would get alone. When ``eos_id`` is given, a row that emits it is finished and filled with
    ``eos_id`` while the others go on; the loop ends when all rows are finished. Dropout is off while generating.
    (``gpt_fast.generate`` does the same for many rows faster, streams, and has a repetition penalty.)

    Raises:
        ValueError: what ``check_generate_args`` refuses, and bad ``top_k``/``top_p``.
    """
    model = unwrap_compiled(model)  # a compiled wrapper would recompile for every new length
    context_size = check_generate_args(model, idx, context_size, temperature, eos_id)
    was_training, cache = model.training, None
    model.eval()
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # (B,)
    with torch.no_grad():  # not inference_mode: PPO trains on these ids, which inference tensors forbid
        for _ in range(max_new_tokens):
            if cache is None:  # the prefill: the whole window, its keys and values kept while later steps fit
                mask = attention_mask[:, -context_size:] if attention_mask is not None else None
                out = model(idx[:, -context_size:], attention_mask=mask, use_cache=idx.shape[1] < context_size,
                            logits_to_keep=1)
            else:  # one new token against the cached keys and values
                out = model(idx[:, -1:], attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            cache = out.get("past_key_values")
            next_ids = next_token(out["logits"][:, -1], temperature, top_k, top_p)  # (B,)
            if eos_id is not None:
                next_ids = next_ids.masked_fill(finished, eos_id)  # a finished row only repeats eos_id
                finished |= next_ids == eos_id
            idx = torch.cat((idx, next_ids[:, None]), dim=1)  # (B, T + 1)
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask, torch.ones_like(attention_mask[:, :1])), dim=1)
            if idx.shape[1] > context_size:
                cache = None  # past the context the window slides: positions must be recomputed
            if bool(finished.all()):
                break
    model.train(was_training)
    return idx


def check_generate_args(model, idx, context_size: int, temperature: float, eos_id: int | None) -> int:
    """``context_size`` clamped to the model's ``cfg.context_length`` (it has no positions past it: a longer window
    would fail once the text outgrows it), after what ``generate`` refuses (``ValueError``): an empty prompt, a
    negative temperature, ``context_size`` < 1, an ``eos_id`` outside the model's vocabulary (it could never be
    sampled, so generation would never stop)."""
    if idx.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. [CLS]) to continue from")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if context_size < 1:
        raise ValueError(f"context_size must be >= 1, got {context_size}")
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return context_size
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id {eos_id} is not a token of this model (vocabulary 0..{cfg.vocab_size - 1}); "
                         f"give the id of its end-of-text token, e.g. [SEP] = 102 for BERT-Chinese")
    return min(context_size, cfg.context_length)
