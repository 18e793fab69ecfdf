"""The optimizers every stage uses and their learning-rate schedule.

* ``make_optimizer``: AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter 2019); or Muon for the
  Transformer blocks' matrices with AdamW for the rest (``MuonAdamW``, as nanochat and the modded-nanogpt speedrun
  train), with ``make_optimizer_groups`` deciding which parameter goes where.
* ``Muon`` and ``newton_schulz``: Muon's update (Jordan et al. 2024), its Newton-Schulz iteration in bf16 where that
  is native and in float32 elsewhere (``newton_schulz_dtype``).
* ``lr_at`` / ``set_lr``: linear warm-up then cosine decay to 10% (as in GPT-3's recipe), applied to every group
  with its ``lr_scale``.

It knows nothing of stages or data: ``training.StageRun`` calls ``lr_at`` and ``set_lr`` before each step.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from plumbing.devices import native_bf16

# optimizer="muon": Muon's rate and the token embedding's AdamW rate, as multiples of the peak learning rate. At
# the demo's 2e-3: Muon 0.02 (nanochat's matrix rate) and embedding 0.06 (bench/README.md: the demo sweep)
MUON_LR_SCALE = 10.0
EMBEDDING_LR_SCALE = 30.0


def make_optimizer(model: nn.Module, learning_rate: float, weight_decay: float,
                   optimizer: str = "adamw", embedding_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW with weight decay on the weight matrices of Linear layers only; biases, norm scales/shifts and
    embeddings (and the head tied to them) are not decayed. With ``embedding_lr_scale`` other than 1 the embedding
    tables form a group of their own whose rate is that many times the schedule's (``set_lr``): the reward model
    learns which tokens read as good or bad mostly there (bench/README.md: the RM recipes).

    ``optimizer="muon"``: ``MuonAdamW`` instead, Muon on the Transformer blocks' matrices at ``MUON_LR_SCALE``
    times the learning rate, AdamW on the token embedding at ``EMBEDDING_LR_SCALE`` times it and on the rest at
    the learning rate (see ``make_optimizer_groups``).
    """
    if optimizer == "muon":
        groups = make_optimizer_groups(model, weight_decay, muon=True, embedding_lr_scale=EMBEDDING_LR_SCALE,
                                       muon_lr_scale=MUON_LR_SCALE)
        return MuonAdamW(groups, lr=learning_rate)
    if optimizer != "adamw":
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {optimizer!r}")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, tables = [], [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        if id(p) in embeddings:
            (tables if embedding_lr_scale != 1.0 else no_decay).append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if tables:
        groups.append({"params": tables, "weight_decay": 0.0, "lr_scale": embedding_lr_scale})
    # the fused kernel updates all parameters in one pass (the per-tensor loop costs seconds a step on a CPU)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=True)


def make_optimizer_groups(model: nn.Module, weight_decay: float, muon: bool = False,
                          embedding_lr_scale: float = 1.0, muon_lr_scale: float = 10.0) -> list[dict]:
    """Parameter groups of a ``gpt_model.GPTModel`` for ``MuonAdamW``: with ``muon``, the 2-D weights of the
    Transformer blocks (attention and MLP matrices) form a Muon group (``"muon": True``) whose learning rate is
    ``muon_lr_scale`` times the schedule's, decayed by ``weight_decay``; the token embedding (and the head tied to it)
    is an AdamW group at ``embedding_lr_scale`` times the schedule's; an untied head is decayed like the matrices in
    ``make_optimizer``; positions, norms and biases are not decayed. Without ``muon`` the block matrices are a
    decayed AdamW group."""
    embedding = model.tok_emb.weight
    blocks = {id(p) for block in model.trf_blocks for p in block.parameters() if p.dim() == 2}
    matrices, embeddings, decay, rest = [], [], [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        if id(p) in blocks:
            matrices.append(p)
        elif p is embedding:
            embeddings.append(p)
        elif p is model.out_head.weight:  # an untied head
            decay.append(p)
        else:
            rest.append(p)
    groups = [{"params": matrices, "weight_decay": weight_decay, "muon": muon,
               "lr_scale": muon_lr_scale if muon else 1.0},
              {"params": embeddings, "weight_decay": 0.0, "lr_scale": embedding_lr_scale},
              {"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


# Keller Jordan's quintic Newton-Schulz coefficients (https://kellerjordan.github.io/posts/muon/), as in
# torch.optim.Muon: chosen for the steepest slope at 0, so 5 steps bring every singular value near 1.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_dtype() -> torch.dtype:
    """The precision of Muon's Newton-Schulz iteration: bf16 where it is computed natively (``native_bf16``), as
    Keller Jordan's Muon and ``torch.optim.Muon`` run it; float32 elsewhere. On a CPU without AVX512-BF16 or AMX a
    bf16 matrix product is emulated and about 35 times slower than float32 (bench/README.md: the demo's
    pretraining step took 12 s instead of 1.2 s on such a CPU, 10.8 s of it in the iteration)."""
    return torch.bfloat16 if native_bf16() else torch.float32


def newton_schulz(grad, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7):
    """The nearest semi-orthogonal matrix to ``grad`` (R, C), approximately: ``steps`` quintic Newton-Schulz
    iterations X <- aX + (bXX^T + c(XX^T)^2)X on X = grad / ||grad||_F in ``dtype``, on the wide orientation (the
    Gram matrix is min(R, C) square). The singular values come out between roughly 0.5 and 1.5, not exactly 1,
    which Muon does not need. Returns (R, C) in ``dtype``. In bf16 it is the operations of ``torch.optim.Muon``'s
    ``_zeropower_via_newtonschulz`` one for one (a test checks the two are bitwise equal)."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # the spectral norm is at most the Frobenius norm: now <= 1
    for _ in range(steps):
        gram = x @ x.T  # (r, r), r = min(R, C)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) for 2-D weights: Nesterov momentum,
    then the update replaced by its ``newton_schulz`` orthogonalisation, scaled by ``sqrt(max(1, rows / cols))``,
    with decoupled weight decay. The same update as ``torch.optim.Muon(adjust_lr_fn="original")``, whose
    iteration always runs in bf16; here ``ns_dtype`` chooses (default ``newton_schulz_dtype()``), so a CPU without
    native bf16 is not ten times slower. The state is ``momentum_buffer`` per parameter, as torch's."""

    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.1, ns_steps: int = 5,
                 ns_dtype: torch.dtype | None = None):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "ns_steps": ns_steps})
        self.ns_dtype = ns_dtype or newton_schulz_dtype()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dim() != 2:
                    raise ValueError(f"Muon updates 2-D weights only, got a gradient of shape {tuple(p.grad.shape)}")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)  # buf = momentum * buf + (1 - momentum) * grad
                update = newton_schulz(p.grad.lerp(buf, momentum), group["ns_steps"], self.ns_dtype)  # Nesterov
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked ``"muon": True``, AdamW for the others, behind one optimizer (one ``step``,
    one ``state_dict``, so ``accelerator.prepare``, gradient accumulation and exact resume work unchanged).

    ``Muon`` replaces each 2-D weight's momentum-SGD update by its nearest semi-orthogonal matrix (5 Newton-Schulz
    iterations), scaled by ``sqrt(max(1, rows / cols))``; nanochat and the modded-nanogpt speedrun train the hidden
    matrices with it and the embeddings, head and gains with AdamW, as here. Both inner optimizers share this object's
    ``param_groups`` and ``state``, so ``set_lr`` and ``lr_scale`` apply to both.
    """

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.95), muon_momentum: float = 0.95):
        adam_groups = [g for g in groups if not g.get("muon")]
        muon_groups = [g for g in groups if g.get("muon")]
        self._adamw = torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=1e-8, fused=True)
        self._muon = Muon(muon_groups, lr=lr, momentum=muon_momentum) if muon_groups else None
        self._num_adam_groups = len(adam_groups)
        super().__init__(self._adamw.param_groups + (self._muon.param_groups if self._muon else []), {})
        self._share()

    def _share(self):
        """Point both inner optimizers at this object's groups and state (again after ``load_state_dict``)."""
        self._adamw.param_groups = self.param_groups[:self._num_adam_groups]
        self._adamw.state = self.state
        if self._muon is not None:
            self._muon.param_groups = self.param_groups[self._num_adam_groups:]
            self._muon.state = self.state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        self._adamw.step()
        if self._muon is not None:
            self._muon.step()


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up to ``peak`` over ``warmup_steps``,
    then cosine decay to ``min_ratio * peak`` at ``total_steps``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr``, times the group's ``"lr_scale"`` if it has one (a new
    head can learn faster than the pretrained body it sits on)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
