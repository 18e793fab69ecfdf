"""The speed work beside the lesson: faster paths of ``gpt_model.py`` that compute the same function.

``gpt_model.py`` is the definition a reader checks by hand; this file holds what makes it fast on real machines, and
imports the lesson (the lesson never imports it). A stage turns it on with one call, ``speed_up(model)``, the way
``lora.add_lora`` swaps layers: every plain ``nn.Linear`` of the model becomes a ``SplitLinear`` and every
``GPTModel`` a ``FastGPTModel``, in place, with the very same parameters (the state dict, its names and the
checkpoint files do not change). Each fast path is tested equal to the lesson's definition (tests/test_gpt_fast.py):

* ``SplitLinear``: a decoding step's few rows times a weight matrix, cut into one block of output features per thread
  and multiplied in one batched product, because one BLAS call for a handful of rows runs on one thread on AMD CPUs
  (bench/README.md, "Decoding against the memory bound"). Equal to ``F.linear`` up to float32 rounding.
* ``chunked_next_token_loss`` (``FastGPTModel.loss``): the next-token cross-entropy straight from the hidden states,
  a chunk of rows at a time, the gradient written during the forward pass, so the (B, T, V) logits are never held:
  the fused linear cross-entropy of Liger Kernel (Hsu et al. 2024) and of Wijmans et al. 2024 ("Cut Your Losses in
  Large-Vocabulary Language Models"), in plain PyTorch on the CPU and with a compiled kernel on a GPU. Equal to
  ``gpt_model.next_token_loss`` within float32 rounding of a sum over the vocabulary.
* ``fused_attention`` (``FastMultiHeadAttention``): PyTorch's fused attention in fp32 on the CPU when bf16 autocast
  made the queries, keys and values bf16, where its bf16 kernel is 3-4x slower (bench/bench_attention.py).
* ``FastGPTModel.decode_step``: a cached one-token step of generation written for one position: its position
  and mask read off the attention mask, no causal mask built, the three projections one product
  (``FastMultiHeadAttention.step_projections``), the queries and keys turned by RoPE in one call. The same
  operations on the same numbers as the general pass.
* ``generate``: the lesson's ``generate`` for many rows at once: k continuations of each prompt from one reading of
  it (``num_samples``), rows that have finished dropped from the batch and the cache, and a ``stream`` callback for
  the server. Greedy, its tokens are the lesson's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_model import (
    GPTModel,
    KVCache,
    MultiHeadAttention,
    apply_rope,
    check_generate_args,
    check_labels,
    next_token,
    rope_angles,
    unwrap_compiled,
)

# Products of at most this many rows (a decoding step's batch) take ``SplitLinear``'s split path; more rows than this
# run F.linear as one BLAS call (bench/README.md: "Decoding against the memory bound", measured at 1 to 64 rows).
SPLIT_ROWS = 32


class SplitLinear(nn.Linear):
    """``nn.Linear`` (y = x W^T + b, W of shape (out, in)), with one more path for decoding on a CPU: ``linear``.

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
        return linear(x, self.weight, self.bias)


def linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` (x: (..., in), weight: (out, in), bias: (out,) or None -> (..., out)), through
    ``split_linear`` where ``SplitLinear``'s docstring says that is faster."""
    out_features, in_features = weight.shape
    # the checks that training and compiled code fail come first: torch.compile must not see the thread count
    if (not torch.is_grad_enabled() and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and x.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and x.numel() <= SPLIT_ROWS * in_features):
        parts = torch.get_num_threads()
        if parts > 1 and out_features % parts == 0:
            return split_linear(x, weight, bias, parts)
    return F.linear(x, weight, bias)


def split_linear(x, weight, bias, parts: int):
    """``F.linear(x, weight, bias)`` as ``parts`` blocks of output features in one ``torch.bmm``."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)  # (N, in)
    blocks = weight.view(parts, -1, in_features)  # (P, out/P, in), a view
    if rows.shape[0] == 1:
        y = torch.bmm(blocks, rows.t().expand(parts, -1, -1)).view(1, -1)  # (P, out/P, 1) -> (1, out)
    else:
        y = torch.bmm(rows.expand(parts, -1, -1), blocks.transpose(1, 2))  # (P, N, out/P)
        y = y.transpose(0, 1).reshape(rows.shape[0], -1)  # (N, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], out_features)  # (..., out)


def fused_attention(queries, keys, values, attn_mask=None, is_causal: bool = False, dropout_p: float = 0.0):
    """``F.scaled_dot_product_attention`` (PyTorch's fused kernels), computed in fp32 on the CPU when autocast has
    made q, k, v bf16. PyTorch's CPU flash-attention kernel is 3-4x slower in bf16 than in fp32 at the demo's
    shapes, forward and backward (``bench/bench_attention.py``), so the upcast makes bf16 training faster and the
    softmax more exact; GPUs keep their bf16 kernels.

    Args as ``F.scaled_dot_product_attention`` (``attn_mask``: bool, True = may attend, as ``attention_reference``'s
    ``visible``). Returns (B, H, Tq, d_h) in the dtype of ``queries``.
    """
    if queries.device.type == "cpu" and queries.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            context = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(), attn_mask=attn_mask,
                                                     is_causal=is_causal, dropout_p=dropout_p)
        return context.to(queries.dtype)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                          dropout_p=dropout_p)


class FastMultiHeadAttention(MultiHeadAttention):
    """``MultiHeadAttention`` whose fused kernel runs in fp32 on the CPU under bf16 autocast (``fused_attention``),
    and whose decoding steps make the queries, keys and values in one product (``step_projections``). Made by
    ``speed_up``."""

    sdpa = staticmethod(fused_attention)

    def stacked_projections(self):
        """[W_query; W_key; W_value] (3E, E) and their biases (3E,) or None, copied into one matrix: one product then
        gives all three (``step_projections``). None when a projection is not a plain ``SplitLinear`` (a LoRA adapter
        adds a term of its own)."""
        layers = (self.W_query, self.W_key, self.W_value)
        if not all(type(layer) is SplitLinear for layer in layers):
            return None
        weight = torch.cat([layer.weight for layer in layers])  # (3E, E)
        bias = torch.cat([layer.bias for layer in layers]) if self.W_query.bias is not None else None  # (3E,)
        return weight, bias

    def step_projections(self, x, stacked=None):
        """The queries, keys and values of one new position per row, side by side on the head axis: x (B, 1, E) ->
        (B, 3H, 1, d_h), heads 0..H-1 the queries, H..2H-1 the keys, 2H..3H-1 the values.

        Given ``stacked`` (``stacked_projections``) and no autocast, the three products are one: the same dot
        products, one call instead of three. Otherwise each layer runs as usual and the results are joined.
        """
        if stacked is not None and not torch.is_autocast_enabled(x.device.type):
            qkv = linear(x, *stacked)  # (B, 1, 3E)
        else:  # under autocast the stacked copy would be cast again at every step; the layers' casts are cached
            qkv = torch.cat([layer(x) for layer in (self.W_query, self.W_key, self.W_value)], dim=-1)  # (B, 1, 3E)
        # one position: (B, 1, 3E) is already (B, 3H, 1, d_h), no transpose needed
        return qkv.view(x.shape[0], 3 * self.num_heads, 1, self.head_dim)


class FastGPTModel(GPTModel):
    """``GPTModel`` whose loss is ``chunked_next_token_loss``: the same value as the lesson's ``next_token_loss``
    of the head's logits, without the (B, T, V) logits in memory; and whose cached one-token steps, at inference,
    run ``decode_step``. Made by ``speed_up``, never built directly."""

    def forward(self, input_ids, attention_mask=None, past_key_values: KVCache | None = None, use_cache=False,
                labels=None, logits_to_keep: int = 0):
        """``GPTModel.forward``; one new token per row after cached ones, without autograd or dropout and with the
        fused attention kernel (``attention="sdpa"``, the default), goes through ``decode_step`` (the same numbers).
        A model with ``attention="math"`` keeps the written-out attention of the general pass."""
        cache = past_key_values
        if (cache is not None and labels is None and input_ids.shape[1] == 1 and not self.training
                and not torch.is_grad_enabled() and self.cfg.attention == "sdpa"
                and 0 < cache.length < self.cfg.context_length
                and (attention_mask is None or attention_mask.shape == (input_ids.shape[0], cache.length + 1))):
            hidden = self.decode_step(input_ids, attention_mask, cache)  # (B, 1, E)
            out = {"last_hidden_state": hidden, "logits": self.out_head(hidden)}  # (B, 1, V)
            if use_cache:
                out["past_key_values"] = cache
            return out
        return super().forward(input_ids, attention_mask, cache, use_cache, labels, logits_to_keep)

    def decode_step(self, input_ids, attention_mask, cache: KVCache):
        """``hidden_states`` for one new token per row after the ``cache.length`` cached ones: (B, 1) ids, mask
        (B, length + 1) or None -> (B, 1, E) final-normed states, its keys and values written into ``cache``.

        The same operations on the same numbers as the general pass, less what a single position does not need:
        the position and the mask of the new token are read off the mask directly (its last column is the new
        token), no causal mask is built, the three projections are one product (``step_projections``) and the
        rotary embedding turns the queries and keys in one call. The stacked projection weights are made at a
        cache's first step and kept on it (``cache.stacked_qkv``) for the rest of its generation: a cache must not
        outlive a change of the weights (each generation makes its own).
        """
        batch_size, past_len = input_ids.shape[0], cache.length
        visible = None
        if attention_mask is None:
            positions = torch.full((batch_size, 1), past_len, device=input_ids.device)  # (B, 1)
        else:
            mask = attention_mask.bool()  # (B, past + 1)
            positions = (mask.sum(dim=1, keepdim=True) - 1).clamp(min=0)  # (B, 1) real tokens before, per row
            if not bool(mask.all()):  # as the general pass: no mask at all when nothing is padding
                visible = mask.clone()
                visible[:, -1] = True  # a padding query sees itself, as there
                visible = visible[:, None, None, :]  # (B, 1, 1, past + 1)
        x = self.tok_emb(input_ids)  # (B, 1, E)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)  # (B, 1, E)
        else:
            rope = rope_angles(self.cfg.emb_dim // self.cfg.n_heads, positions)  # (B, 1, 1, d_h/2)
        if not hasattr(cache, "stacked_qkv"):  # this generation's weights, stacked at its first step, freed with it
            cache.stacked_qkv = [block.att.stacked_projections() for block in self.trf_blocks]
        for layer, block in enumerate(self.trf_blocks):
            att, heads = block.att, block.att.num_heads
            qkv = att.step_projections(block.norm1(x), cache.stacked_qkv[layer])  # (B, 3H, 1, d_h)
            queries_keys, values = qkv[:, :2 * heads], qkv[:, 2 * heads:]  # (B, 2H, 1, d_h), (B, H, 1, d_h)
            if rope is not None:
                queries_keys = apply_rope(queries_keys, rope)  # both turned in one call
            queries, keys = queries_keys.split(heads, dim=1)  # (B, H, 1, d_h) each
            keys, values = cache.update(layer, keys, values)  # (B, H, past + 1, d_h)
            context = att.sdpa(queries, keys, values, attn_mask=visible)  # (B, H, 1, d_h)
            x = x + att.out_proj(context.transpose(1, 2).reshape(batch_size, 1, att.d_out))  # (B, 1, E)
            x = x + block.ff(block.norm2(x))  # (B, 1, E)
        cache.length += 1
        return self.final_norm(x)  # (B, 1, E)

    def loss(self, last_hidden_state, labels):  # (B, T, E), (B, T) -> float32 scalar
        return chunked_next_token_loss(last_hidden_state, self.out_head.weight, labels)


def speed_up(*models: nn.Module):
    """Turn the fast paths on in ``models``, in place: each plain ``nn.Linear`` (not a subclass such as
    ``lora.LoRALinear``) becomes a ``SplitLinear``, each ``MultiHeadAttention`` a ``FastMultiHeadAttention``, each
    ``GPTModel`` (a policy, a reward model's backbone) a ``FastGPTModel``. Parameters, buffers and state-dict names
    stay as they are, so call it before or after loading weights, before ``accelerator.prepare`` or
    ``torch.compile``. Returns the first model (all of them when given several). None is passed over (a stage
    without a reward model)."""
    for model in models:
        for module in (unwrap_compiled(model).modules() if model is not None else ()):
            if type(module) is nn.Linear:
                module.__class__ = SplitLinear
            elif type(module) is GPTModel:
                module.__class__ = FastGPTModel
            elif type(module) is MultiHeadAttention:
                module.__class__ = FastMultiHeadAttention
    return models[0] if len(models) == 1 else models


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
    gradients of ``hidden`` and ``weight`` before the next chunk, so the backward pass only rescales them. Under
    autocast the matmuls run in the autocast dtype and the softmax in float32, as ``out_head`` +
    ``next_token_loss`` would. The gradient cannot be differentiated again (no double backward).
    """
    check_labels(labels, hidden.shape[:-1])
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


def repeat_rows(cache: KVCache, k: int) -> None:
    """Each row of ``cache`` k times over, in place: row b becomes rows b*k .. b*k+k-1 (several continuations of one
    prompt share its keys and values). Only the filled positions are copied."""
    L, B, H, max_len, d = cache.shape
    cache.shape, n = (L, B * k, H, max_len, d), cache.length
    if cache.keys is not None:
        keys, values = cache.keys, cache.values
        cache.keys, cache.values = (_empty_like(cache, t) for t in (keys, values))
        for new, old in ((cache.keys, keys), (cache.values, values)):
            new.view(L, B, k, H, max_len, d)[:, :, :, :, :n] = old[:, :, None, :, :n]  # (L, B, k, H, n, d_h)


def keep_rows(cache: KVCache, rows) -> None:
    """Keep only the batch rows ``rows`` (a (b,) LongTensor of indices) of ``cache``, in place: rows whose
    generation has finished stop costing compute in later steps. Only the filled positions are copied."""
    cache.shape, n = (cache.shape[0], len(rows), *cache.shape[2:]), cache.length
    if cache.keys is not None:
        keys, values = cache.keys, cache.values
        cache.keys, cache.values = (_empty_like(cache, t) for t in (keys, values))
        for new, old in ((cache.keys, keys), (cache.values, values)):
            new[:, :, :, :n] = old[:, rows, :, :n]  # (L, b, H, n, d_h)


def _empty_like(cache: KVCache, buffer):
    """An empty buffer of ``cache.shape`` in ``buffer``'s dtype and device: positions past the filled ones are
    written before they are read, as in a new cache."""
    return torch.empty(cache.shape, dtype=buffer.dtype, device=buffer.device)


class Batch:
    """The state of a batched generation: the ids so far (B, T) of every row, its mask, which rows have finished,
    and which rows the model still computes (``rows``: None for all; finished rows are dropped as they pile up) with
    their KV cache and last logits."""

    def __init__(self, idx, attention_mask, context_size: int, max_new_tokens: int):
        self.idx, self.context_size = idx, context_size
        # the positions a cache will hold: the prompt and every new token but the last (whose keys nothing reads)
        self.cache_len = min(context_size, idx.shape[1] + max_new_tokens - 1)
        self.padded = attention_mask is not None and not bool(attention_mask.all())
        # no padding: the model needs no mask, so no step builds, checks or extends one
        self.attention_mask = attention_mask if self.padded else None
        self.finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        self.rows, self.cache, self.logits, self.last = None, None, None, None

    def live(self, t):
        """The rows of ``t`` (a (B, ...) tensor or None) that the model still computes."""
        return t if self.rows is None or t is None else t[self.rows]

    def prefill(self, model, num_samples: int) -> None:
        """A full pass over the last ``context_size`` tokens of the live rows (their keys and values kept while
        later steps still fit); with ``num_samples`` k > 1, each row then becomes k rows sharing that reading."""
        window = self.live(self.idx)[:, -self.context_size:]
        mask = self.live(self.attention_mask)[:, -self.context_size:] if self.padded else None
        use_cache = self.idx.shape[1] < self.context_size
        # a cache of the positions this generation fills, not of the model's whole context: the copies of
        # ``repeat_rows`` and ``keep_rows`` and the memory scale with it
        cfg = getattr(model, "cfg", None)  # a model without one makes its own cache
        cache = KVCache(cfg, window.shape[0], self.cache_len) if use_cache and cfg is not None else None
        out = model(window, attention_mask=mask, past_key_values=cache, use_cache=use_cache, logits_to_keep=1)
        self.cache, self.logits = out.get("past_key_values"), out["logits"][:, -1, :]  # (B, V)
        if num_samples > 1:  # only at the first step, when every row is live
            self.idx, self.logits, self.finished = (t.repeat_interleave(num_samples, 0)
                                                    for t in (self.idx, self.logits, self.finished))
            if self.padded:
                self.attention_mask = self.attention_mask.repeat_interleave(num_samples, 0)
            if self.cache is not None:
                repeat_rows(self.cache, num_samples)

    def append(self, next_ids, eos_id, stream) -> None:
        """Add a column of tokens (b,) of the live rows: finished and dropped rows get ``eos_id``; ``stream`` sees
        the (B,) column and may finish rows (a (B,) bool mask, or None)."""
        if self.rows is not None:  # the dropped rows have finished: they get eos_id
            next_ids = torch.full_like(self.finished, eos_id, dtype=torch.long).index_copy(0, self.rows, next_ids)
        if eos_id is not None:
            next_ids = next_ids.masked_fill(self.finished, eos_id)  # (B,)
            self.finished |= next_ids == eos_id
        self.idx = torch.cat((self.idx, next_ids[:, None]), dim=1)  # (B, T + 1)
        if self.padded:
            self.attention_mask = torch.cat((self.attention_mask, torch.ones_like(self.attention_mask[:, :1])), 1)
        self.last = next_ids
        if stream is not None:
            stop = stream(next_ids)
            if stop is not None:  # rows the caller ends: later tokens of theirs are eos_id (or ignored)
                self.finished |= torch.as_tensor(stop, dtype=torch.bool, device=self.finished.device)

    def drop_finished(self) -> None:
        """Once a quarter of the computed rows have finished, stop computing them (each would cost a running row's
        step for a token that is ``eos_id`` anyway). Sampled rows then draw other random numbers than before."""
        running = ~self.live(self.finished)  # (b,)
        if 4 * int(running.sum()) <= 3 * running.numel():
            kept = running.nonzero().squeeze(1)  # (b',)
            self.rows = kept if self.rows is None else self.rows[kept]
            if self.cache is not None:
                keep_rows(self.cache, kept)

    def step(self, model) -> None:
        """The next logits of the live rows: one new token against the cached keys and values while the sequence
        fits in ``context_size``; past it the window slides, so the next step is a new full pass."""
        if self.cache is not None and self.idx.shape[1] <= self.context_size:
            out = model(self.live(self.last)[:, None], attention_mask=self.live(self.attention_mask),
                        past_key_values=self.cache, use_cache=True)
            self.logits = out["logits"][:, -1, :]  # (b, V)
        else:
            self.cache, self.logits = None, None


def generate(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, top_p=None, eos_id=None,
             attention_mask=None, repetition_penalty=1.0, stream=None, num_samples=1):
    """``gpt_model.generate`` for many rows at once; returns (B, T + n) LongTensor, or (B * k, T + n) with
    ``num_samples`` k > 1: the k continuations of row b in rows b*k .. b*k+k-1, from one reading of the prompt whose
    cached keys and values are copied k times.

    As the lesson's ``generate``: tokens by ``gpt_model.next_token`` (greedy, or sampled with torch's global RNG),
    the KV cache while the sequence fits in ``context_size`` (clamped to the model's), a sliding window past it,
    left padding with ``attention_mask``, each row ending at its own ``eos_id`` and filled with it while the others
    go on. Beyond it: once a quarter of the rows computed have finished they are dropped from the batch and the
    cache (``Batch.drop_finished``); ``stream``, if given, is called with each new (B,) column of tokens and may
    return a (B,) bool mask of rows to finish there as if they had emitted ``eos_id`` (a stop string was written,
    the reader left), or None. Dropout is off while generating.

    ``repetition_penalty`` (CTRL's, ``apply_repetition_penalty``) makes the tokens a row holds already less likely.

    Raises:
        ValueError: as the lesson's ``generate``, and ``num_samples`` < 1 or ``repetition_penalty`` <= 0.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    model = unwrap_compiled(model)  # a compiled wrapper would recompile for every new length
    context_size = check_generate_args(model, idx, context_size, temperature, eos_id)
    if max_new_tokens <= 0:  # nothing to generate: each row, k times over
        return idx.repeat_interleave(num_samples, 0)
    batch = Batch(idx, attention_mask, context_size, max_new_tokens)
    # no_grad, not inference_mode: under CPU autocast that turns off the cache of bf16 weight copies (every step
    # would cast every weight again, bench/README.md), and PPO trains on these ids, which inference mode forbids
    with torch.no_grad():
        was_training = model.training
        model.eval()
        for written in range(1, max_new_tokens + 1):
            if batch.logits is None:
                batch.prefill(model, num_samples)
                num_samples = 1
            logits = batch.logits
            if repetition_penalty != 1.0:
                logits = apply_repetition_penalty(logits.float(), batch.live(batch.idx), repetition_penalty)
            next_ids = next_token(logits, temperature, top_k, top_p)
            batch.append(next_ids, eos_id, stream)
            if bool(batch.finished.all()) or written == max_new_tokens:
                break  # the last token's logits would never be read: no pass for them
            if eos_id is not None:
                batch.drop_finished()
            batch.step(model)
        model.train(was_training)
    return batch.idx


def apply_repetition_penalty(logits, idx, penalty: float):
    """Make tokens already in ``idx`` (B, T) less likely (Keskar et al. 2019, CTRL): a positive logit is divided by
    ``penalty``, a negative one multiplied. (B, V) -> (B, V)."""
    seen = torch.gather(logits, 1, idx)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, idx, seen)
