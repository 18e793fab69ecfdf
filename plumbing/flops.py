"""How much arithmetic training does, and how much of the hardware it uses: FLOPs per token and MFU.

* ``training_flops_per_token``: the matrix FLOPs of one forward and backward pass per token, 6N + 12·L·H·Q·T, the
  count of the PaLM paper's appendix B (Chowdhery et al. 2022) that nanoGPT's ``estimate_mfu`` uses;
* ``BF16_PEAK_FLOPS``, ``bf16_peak`` and ``peak_flops``: the dense bf16 peak of the GPUs whose datasheets we know;
* ``utilisation``: achieved FLOP/s and, where the peak is known, the model-FLOPs utilisation (MFU), achieved / peak.

A CPU has no entry in the table: its figure is printed without a percentage (its peak depends on the cores, the
clock and which vector units the kernels use, none of which torch reports).
"""

from __future__ import annotations

import re

import torch

from gpt_model import GPTConfig

# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from NVIDIA's datasheets: A100 (SXM4 and PCIe) 312 TFLOPS;
# H100 SXM5 989.4 (1,979 with sparsity), H100 PCIe 756, H100 NVL 835; H200 SXM 989.4 (the H100's tensor cores),
# H200 NVL 835; L4 121 (242 with sparsity); GeForce RTX 4090 165.2 with FP32 accumulate (Ada Lovelace whitepaper,
# 330.4 with sparsity). Matched in this order, as whole words, against torch.cuda.get_device_name(): the longer
# names first ("H100 PCIe" before "H100"), and "L4" is not "L40S".
BF16_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("RTX 4090", 165.2e12),
)


def matmul_parameters(cfg: GPTConfig, lm_head: bool = True) -> int:
    """N: the parameters every token is multiplied through, counted from ``cfg``: the blocks (attention and MLP
    matrices and biases, the two norms), the final norm and, with ``lm_head``, the output head (V x E). The token
    and position embeddings are looked up, not multiplied, so they are left out; a tied head is counted once, as the
    head. This is nanoGPT's ``get_num_params()`` for its tied GPT-2, and a reward model (``lm_head=False``) has a
    (E -> 1) head instead, E + 1 parameters."""
    e, hidden = cfg.emb_dim, 4 * cfg.emb_dim
    norm = e if cfg.norm == "rmsnorm" else 2 * e  # scale (and shift)
    attention = 3 * e * e + (3 * e if cfg.qkv_bias else 0) + e * e + e  # W_query, W_key, W_value, out_proj
    mlp = e * hidden + hidden + hidden * e + e  # up (E -> 4E) and down (4E -> E), with biases
    head = cfg.vocab_size * e if lm_head else e + 1
    return cfg.n_layers * (attention + mlp + 2 * norm) + norm + head


def training_flops_per_token(cfg: GPTConfig, seq_len: int, lm_head: bool = True) -> int:
    """FLOPs of one training step (forward and backward) per token of sequences ``seq_len`` long.

    6N for the matrices (2 per parameter forward, 4 backward: the gradients of the input and of the weight) plus
    12·L·H·Q·T for attention (Q = d_h: the scores QK^T and the weighted sum of V, 2·2·T·d_h FLOPs per head and
    token forward, times 3 with backward), as PaLM's appendix B counts them: the full T x T score matrix, although a
    causal mask leaves half of it unused. Layer norms, GELU, softmax and the optimizer are not counted. N is
    ``matmul_parameters(cfg, lm_head)``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    head_dim = cfg.emb_dim // cfg.n_heads
    return 6 * matmul_parameters(cfg, lm_head) + 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def bf16_peak(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU called ``name`` in ``BF16_PEAK_FLOPS``, or None if unlisted."""
    return next((peak for key, peak in BF16_PEAK_FLOPS if re.search(rf"\b{re.escape(key)}\b", name)), None)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak (FLOP/s) of ``device`` (``bf16_peak`` of its name), or None (a CPU, an unlisted GPU)."""
    return bf16_peak(device_name(device)) if device.type == "cuda" else None


def utilisation(flops_per_token: float, tokens_per_second: float, peak: float | None) -> dict:
    """{"flop_s": achieved FLOP/s, "mfu": achieved / ``peak`` (a fraction), or no "mfu" when the peak is unknown}."""
    achieved = flops_per_token * tokens_per_second
    return {"flop_s": achieved, **({"mfu": achieved / peak} if peak else {})}


def format_utilisation(values: dict) -> str:
    """"3.1 TFLOP/s" or "412 TFLOP/s (MFU 41.6%)" from ``utilisation``'s dict."""
    flop_s = values["flop_s"]
    text = f"{flop_s / 1e12:.3g} TFLOP/s" if flop_s >= 1e11 else f"{flop_s / 1e9:.3g} GFLOP/s"
    return text + (f" (MFU {values['mfu']:.1%})" if "mfu" in values else "")
