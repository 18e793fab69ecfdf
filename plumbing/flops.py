"""How much arithmetic a stage does on its models, and how much of the hardware it uses.

* ``pass_flops``: the matrix FLOPs of one call of a model (forward, or forward and backward), and
  ``training_flops_per_token``, one training pass per token: 6N + 12·L·H·Q·T, the count of the PaLM paper's
  appendix B (Chowdhery et al. 2022) that nanoGPT's ``estimate_mfu`` uses;
* ``FlopCounter`` and ``counting_as``: a forward hook on each model a stage runs adds every call's ``pass_flops``,
  by kind (training, scoring, sampling, the held-out measurement);
* ``BF16_PEAK_FLOPS``, ``bf16_peak`` and ``peak_flops``: the dense bf16 peak of the GPUs whose datasheets we know;
* ``matmul_flop_s``: what one large matrix product reaches on this device, the yardstick where no peak is known;
* ``speed_record``, ``utilisation``, ``format_utilisation`` and ``format_speed``: a run's FLOP/s and the MFU
  (achieved / peak) or the share of the matrix product's FLOP/s, as recorded and as printed.

A CPU has no entry in the peak table (its peak depends on the cores, the clock and which vector units the kernels
use, none of which torch reports): its FLOP/s is read against the matrix product measured in the same process.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from contextlib import contextmanager

import torch

from gpt_model import GPTConfig, GPTModel, RewardModel

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


def pass_flops(cfg: GPTConfig, rows: int, tokens: int, past: int = 0, head_tokens: float | None = None,
               lm_head: bool = True, trained_share: float | None = None, attention_mask=None) -> int:
    """FLOPs of one call of a model: ``rows`` sequences of ``tokens`` new positions each, after ``past`` positions
    read from a KV cache, with the head on ``head_tokens`` positions per row (default: every new position).

    Forward, per row: 2 FLOPs per parameter and token through the blocks and the final norm, 2 per head parameter
    and head position (V·E for ``lm_head``, else a (E -> 1) ``ScalarHead``'s E + 1), and 4·L·E·(past + tokens) per
    new token for attention (QK^T and the weighted sum of V over every key position, the full rectangle as PaLM's
    appendix B counts it). With ``trained_share`` (the share of the parameters that get gradients: 1.0 for full
    training, near 0 for LoRA) the backward pass is added: the input gradients (as many FLOPs as the forward's
    matrices, twice its attention) and the weight gradients of the trained share. One full training pass is
    thus 3x the forward pass, ``training_flops_per_token``'s 6N + 12·L·H·Q·T per token.

    With ``attention_mask`` (rows, past + tokens; 1 = a real token) only real tokens count, as model FLOPs do: a row
    of n real new tokens among k real keys is n tokens through the matrices and n·k query-key pairs; padding is work
    the hardware does but not the model's.

    Raises ``ValueError`` for ``tokens`` < 1.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    head = cfg.vocab_size * cfg.emb_dim if lm_head else cfg.emb_dim + 1
    body = matmul_parameters(cfg, lm_head) - head  # the blocks and the final norm
    if attention_mask is None:
        new, pairs = rows * tokens, rows * tokens * (past + tokens)
    else:
        real = attention_mask.sum(dim=1).double()  # (rows,) real keys
        real_new = attention_mask[:, -tokens:].sum(dim=1).double()  # (rows,) real new tokens
        new, pairs = real_new.sum().item(), (real_new * real).sum().item()
    head_positions = new if head_tokens is None else rows * head_tokens
    matrices = 2 * (body * new + head * head_positions)
    attention = 4 * cfg.n_layers * cfg.emb_dim * pairs
    if trained_share is not None:
        matrices, attention = matrices * (2 + trained_share), 3 * attention
    return round(matrices + attention)


def training_flops_per_token(cfg: GPTConfig, seq_len: int, lm_head: bool = True) -> int:
    """FLOPs of one training step (forward and backward) per token of sequences ``seq_len`` long: 6N for the
    matrices (2 per parameter forward, 4 backward: the gradients of the input and of the weight) plus 12·L·H·Q·T
    for attention (Q = d_h), as PaLM's appendix B counts them (``pass_flops`` of one full training pass over
    ``seq_len`` tokens, per token). Layer norms, GELU, softmax and the optimizer are not counted. N is
    ``matmul_parameters(cfg, lm_head)``. Raises ``ValueError`` for ``seq_len`` < 1."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return pass_flops(cfg, 1, seq_len, lm_head=lm_head, trained_share=1.0) // seq_len


_KINDS: list[str] = []  # the kinds ``counting_as`` set, outermost first


@contextmanager
def counting_as(kind: str):
    """Count every pass of a watched model run inside as ``kind`` (``FlopCounter``), whatever pass it is: the
    held-out measurement is counted apart from the stage's own work this way. The outermost one decides: a scoring
    pass that reads a KV cache (``rollouts.response_logprobs``) is "forward" in a stage and "held_out" inside the
    held-out measurement."""
    _KINDS.append(kind)
    try:
        yield
    finally:
        _KINDS.pop()


class FlopCounter:
    """The FLOPs a process runs on its models, summed by kind in ``flops`` ({kind: FLOPs}). A forward hook on each
    watched ``GPTModel`` and ``RewardModel`` reads the call's shapes and adds its ``pass_flops``:

    * "train": the output will be differentiated (gradients on, and the output needs them): forward and backward,
      the weight gradients of the share of parameters that train;
    * "sample": a step of generation: the pass reads or fills a KV cache, or keeps its last position's logits alone
      (a prompt's prefill; ``gpt_fast.generate``);
    * "forward": any other pass: reference and old log-probs, reward and critic scores, evaluation;
    * the kind of the outermost ``counting_as`` around the pass, whatever it is.

    What is counted is the model's work the call asks for: the real tokens of ``attention_mask`` (padding is not
    counted), the head on the real positions it keeps (``logits_to_keep``) or predicts (``labels`` other than
    -100), attention over the cached keys too.
    The hook reads ``input_ids`` (first) and the options by keyword, as every caller in this project passes them.
    """

    def __init__(self, *models):
        self.flops: Counter = Counter()
        self._watched: set[int] = set()
        self.watch(*models)

    @property
    def total(self) -> int:
        """The FLOPs of every kind together."""
        return sum(self.flops.values())

    def watch(self, *models) -> None:
        """Count the passes of every ``GPTModel`` and ``RewardModel`` in ``models`` (their submodules included, so
        a wrapper from Accelerate or PPO's policy-and-critic module will do). A reward model's backbone is part of
        it, a module already watched is not watched twice, and None is passed over."""
        for model in models:
            modules = list(model.modules()) if model is not None else []
            backbones = {id(m.backbone) for m in modules if isinstance(m, RewardModel)}
            for module in modules:
                if isinstance(module, (GPTModel, RewardModel)) and id(module) not in backbones | self._watched:
                    self._watched.add(id(module))
                    module.register_forward_hook(self._count, with_kwargs=True)

    @torch.compiler.disable
    def _count(self, module, args, kwargs, output) -> None:
        rows, tokens = (args[0] if args else kwargs["input_ids"]).shape
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")  # (B, past + T) or None
        cache, keep = kwargs.get("past_key_values"), kwargs.get("logits_to_keep") or 0
        labels = kwargs.get("labels")  # the positions whose ids go through the head
        past = cache.length - tokens if cache is not None else 0  # the hook runs after the pass filled the cache
        if labels is not None:
            head = int((labels != -100).sum()) / rows
        elif keep:  # the kept positions, of which only the real ones count (an answer's padding after its end)
            head = min(keep, tokens) if mask is None else int(mask[:, -min(keep, tokens):].sum()) / rows
        else:
            head = None
        trains = torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                                 for v in output.values())
        share = None
        if trains:
            sizes = [(p.numel(), p.requires_grad) for p in module.parameters()]
            share = sum(n for n, grad in sizes if grad) / sum(n for n, _ in sizes)
        sampling = bool(kwargs.get("use_cache")) or cache is not None or keep == 1
        kind = _KINDS[0] if _KINDS else "train" if trains else "sample" if sampling else "forward"
        lm_head = isinstance(module, GPTModel)
        self.flops[kind] += pass_flops(module.cfg, rows, tokens, past, head if lm_head else None, lm_head, share, mask)


def matmul_flop_s(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None,
                  repeats: int = 5) -> float:
    """FLOP/s of one large square matrix product on ``device`` in ``dtype``: 2·n³ FLOPs (n = ``size``, by default
    1024 on a CPU, where it reaches the kernels' full speed, and 8192 on a GPU), the fastest of ``repeats`` after a
    warm-up. What the machine's matrix kernels reach on the work they suit best: the yardstick a stage's FLOP/s is
    read against (its "matmul share") where no datasheet peak is known."""
    n = size or (8192 if device.type == "cuda" else 1024)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    best = float("inf")
    for attempt in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:  # the first is the warm-up
            best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def speed_record(flops: dict, seconds: float, device: torch.device, yardstick: torch.dtype | None = None) -> dict:
    """What a run records of its arithmetic: ``flops`` ({kind: FLOPs}, ``FlopCounter.flops``), ``flop_s`` (their sum
    over ``seconds``) and, given the ``yardstick`` dtype, ``matmul_flop_s`` (``matmul_flop_s`` measured now, on
    ``device`` in that dtype) and the device's ``peak_flops``: what ``report.achieved_flops`` reads."""
    record = {"flops": dict(sorted(flops.items())), "flop_s": sum(flops.values()) / max(seconds, 1e-9)}
    if yardstick is not None:
        record.update(matmul_flop_s=matmul_flop_s(device, yardstick), peak_flops=peak_flops(device))
    return record


def format_speed(record: dict) -> str:
    """A run's FLOP/s from its ``speed_record``: with the MFU where the device's peak is known, else the share of
    the large matrix product's FLOP/s, e.g. "38.5 GFLOP/s (21% of a matmul)"; "—" for a record without FLOP/s."""
    flop_s, matmul = record.get("flop_s"), record.get("matmul_flop_s")
    if not flop_s:
        return "—"
    values = utilisation(flop_s, record.get("peak_flops"))
    share = f" ({flop_s / matmul:.0%} of a matmul)" if matmul and "mfu" not in values else ""
    return format_utilisation(values) + share


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def bf16_peak(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU called ``name`` in ``BF16_PEAK_FLOPS``, or None if unlisted."""
    return next((peak for key, peak in BF16_PEAK_FLOPS if re.search(rf"\b{re.escape(key)}\b", name)), None)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak (FLOP/s) of ``device`` (``bf16_peak`` of its name), or None (a CPU, an unlisted GPU)."""
    return bf16_peak(device_name(device)) if device.type == "cuda" else None


def utilisation(flop_s: float, peak: float | None) -> dict:
    """{"flop_s": achieved FLOP/s, "mfu": ``flop_s`` / ``peak`` (a fraction), or no "mfu" when the peak is unknown}."""
    return {"flop_s": flop_s, **({"mfu": flop_s / peak} if peak else {})}


def format_utilisation(values: dict) -> str:
    """"3.1 TFLOP/s" or "412 TFLOP/s (MFU 41.6%)" from ``utilisation``'s dict."""
    flop_s = values["flop_s"]
    text = f"{flop_s / 1e12:.3g} TFLOP/s" if flop_s >= 1e11 else f"{flop_s / 1e9:.3g} GFLOP/s"
    return text + (f" (MFU {values['mfu']:.1%})" if "mfu" in values else "")
