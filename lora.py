"""LoRA written by hand: small trainable low-rank updates beside the frozen linear layers of a ``GPTModel``.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv 2106.09685). A pretrained weight W
(out, in) stays frozen, and a low-rank update B A is learned beside it:

    y = x W^T + b + (alpha / r) * x A^T B^T,    A (r, in), B (out, r), r much smaller than in and out

B starts at zero, so the update is zero and step 0 is exactly the base model; A starts random. The paper's text
draws A from a Gaussian (its section 4.1); its reference code (loralib) and ``peft`` draw it as ``nn.Linear`` draws
a weight, Kaiming-uniform with a = sqrt(5), and so does this module. Only A and B train: r * (in + out) numbers per
layer instead of in * out. After training, (alpha / r) B A can be added into W once (``merge``), and the adapted
model then runs at the base's cost.

Which layers get an adapter is a choice: ``LORA_TARGETS`` names the six linear layers of a ``TransformerBlock``;
the default is the attention's query and value projections, the paper's choice (its section 7.1).

Shapes in comments: ``...`` any leading dimensions (B, T), r the rank, in / out the adapted layer's features.

What this module does not do: it never copies a base weight (an adapted layer holds the base layer's very Parameter
objects), it knows no files (adapter checkpoints are ``plumbing/checkpoint.py``'s), and it does not export to
``peft``.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_fast import SplitLinear
from gpt_model import GPTModel, RewardModel, unwrap_compiled

# the linear layers of a TransformerBlock that may carry an adapter, as module paths inside the block
LORA_TARGETS = ("att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0", "ff.layers.2")
DEFAULT_TARGETS = ("att.W_query", "att.W_value")  # Hu et al. 2021, section 7.1: query and value
SHORT_NAMES = {target.removeprefix("att."): target for target in LORA_TARGETS if target.startswith("att.")}


def check_settings(rank: int, alpha: float, dropout: float) -> None:
    """Raise ``ValueError`` naming the bad value unless rank >= 1 (an int), alpha > 0 and 0 <= dropout < 1."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")


class LoRALinear(SplitLinear):
    """A frozen ``Linear`` plus a trainable low-rank update: y = x W^T + b + (alpha / r) * dropout(x) A^T B^T.

    Built from an existing layer, ``LoRALinear(layer, rank, alpha)``: ``weight`` (out, in) and ``bias`` (out,) are
    that layer's very Parameter objects (no copy), frozen; ``lora_A`` (r, in) and ``lora_B`` (out, r) are new and
    trainable, on the weight's device and in its dtype. ``scaling`` = alpha / r.

    Args:
        base: the ``nn.Linear`` to adapt; the new layer takes over its train/eval mode.
        rank: r >= 1, the rank of the update.
        alpha: > 0, the update's scale before division by r.
        dropout: the probability of zeroing an input feature on the adapter's path only (the base sees x whole).
    Raises:
        ValueError: rank < 1, alpha <= 0 or dropout outside [0, 1).

    ``merged`` says whether the update has been added into ``weight`` (``merge`` / ``unmerge``); ``enabled`` False
    switches the adapter off, so that the layer computes the base layer alone (``adapters_off``).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        check_settings(rank, alpha, dropout)
        # on the meta device nn.Linear allocates nothing: its placeholders are replaced by the base's parameters
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight  # (out, in), the base layer's own Parameter
        self.bias = base.bias  # (out,) or None
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        like = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))  # (out, r): B A = 0 at step 0
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # U(-1/sqrt(in), 1/sqrt(in)), nn.Linear's weight init
        self.lora_dropout = nn.Dropout(dropout)
        self.merged, self.enabled = False, True
        self.train(base.training)

    def forward(self, x):  # (..., in) -> (..., out)
        y = super().forward(x)  # (..., out) the base layer x W^T + b, through SplitLinear's CPU decoding path too
        if self.merged or not self.enabled:
            return y
        h = F.linear(self.lora_dropout(x), self.lora_A)  # (..., r)  x A^T
        return y + self.scaling * F.linear(h, self.lora_B)  # (..., out)  + (alpha / r) x A^T B^T

    def delta_weight(self):
        """The update this adapter adds to ``weight``: (alpha / r) * B A, (out, in)."""
        return self.scaling * (self.lora_B @ self.lora_A)  # (out, r) @ (r, in) -> (out, in)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into ``weight`` in place; forward then runs the base path alone, at the base's cost.

        Raises:
            ValueError: already merged.
        """
        if self.merged:
            raise ValueError("this LoRA adapter is merged already")
        self.weight += self.delta_weight()  # (out, in)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update from ``weight`` again (W comes back up to float rounding), so A and B can train on.

        Raises:
            ValueError: not merged.
        """
        if not self.merged:
            raise ValueError("this LoRA adapter is not merged")
        self.weight -= self.delta_weight()  # (out, in)
        self.merged = False

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def parse_targets(text: str) -> tuple[str, ...]:
    """The targets named by a ``--lora_targets`` value: comma-separated names from ``LORA_TARGETS``, the short
    attention names (``W_query``, ``W_key``, ``W_value``, ``out_proj``), or ``all``. Returned in ``LORA_TARGETS``
    order, each once: ``"W_value,W_query"`` -> ``("att.W_query", "att.W_value")``.

    Raises:
        ValueError: an unknown name, or none at all; the message names it and the allowed ones.
    """
    return canonical_targets([name.strip() for name in text.split(",") if name.strip()])


def canonical_targets(names) -> tuple[str, ...]:
    """``names`` (full or short target names, or ``all``) as full names in ``LORA_TARGETS`` order; ``ValueError``
    as ``parse_targets``."""
    if "all" in names:
        return LORA_TARGETS
    full = [SHORT_NAMES.get(name, name) for name in names]
    unknown = [name for name, target in zip(names, full) if target not in LORA_TARGETS]
    if unknown or not full:
        problem = f"unknown LoRA target {unknown[0]!r}" if unknown else "no LoRA target given"
        raise ValueError(f"{problem}; choose from {', '.join(LORA_TARGETS)} (or the short {', '.join(SHORT_NAMES)}), "
                         f"comma-separated, or 'all'")
    return tuple(target for target in LORA_TARGETS if target in full)


def gpt_of(model) -> GPTModel:
    """The ``GPTModel`` of ``model``: itself, or a ``RewardModel``'s backbone (out of a torch.compile wrapper)."""
    model = unwrap_compiled(model)
    if isinstance(model, RewardModel):
        return model.backbone
    if not isinstance(model, GPTModel):
        raise TypeError(f"LoRA adapts a GPTModel or a RewardModel, not a {type(model).__name__}")
    return model


def target_slots(model, targets=LORA_TARGETS):
    """(parent module, attribute name) of each target layer in each block of ``model``, block by block:
    ``"att.W_query"`` gives (block.att, "W_query"), ``"ff.layers.0"`` (block.ff.layers, "0")."""
    for block in gpt_of(model).trf_blocks:
        for target in targets:
            path, name = target.rsplit(".", 1)
            yield block.get_submodule(path), name


def lora_layers(model) -> list[LoRALinear]:
    """Every ``LoRALinear`` of ``model``, in module order."""
    return [m for m in unwrap_compiled(model).modules() if isinstance(m, LoRALinear)]


def has_lora(model) -> bool:
    """Whether ``model`` carries LoRA adapters (merged or not)."""
    return bool(lora_layers(model))


def add_lora(model, rank: int, alpha: float, targets=DEFAULT_TARGETS, dropout: float = 0.0):
    """Give ``model`` LoRA adapters (Hu et al. 2021) and freeze everything else; in place, returns ``model``.

    Each target ``Linear`` of every ``TransformerBlock`` is replaced by a ``LoRALinear`` over the very same weight
    and bias Parameters (no copy: memory grows by the adapters alone). Every other parameter is frozen too: the
    embeddings, the norms, the output head (tied to the token embedding or not) and a reward model's scalar head;
    a stage that trains one of them sets its ``requires_grad`` back itself. The model's outputs are unchanged
    (B = 0) until A and B train.

    Args:
        model: a ``GPTModel``, or a ``RewardModel`` (its ``backbone`` gets the adapters).
        rank, alpha, dropout: as ``LoRALinear``'s.
        targets: names from ``LORA_TARGETS`` (short names too), or one string as ``parse_targets`` reads it.
    Raises:
        ValueError: a bad rank, alpha, dropout or target (the message names it), or adapters already there
            (``merge_lora`` them first).
    """
    check_settings(rank, alpha, dropout)
    targets = parse_targets(targets) if isinstance(targets, str) else canonical_targets(list(targets))
    if has_lora(model):
        raise ValueError("the model has LoRA adapters already; merge them into the weights first (merge_lora)")
    for p in model.parameters():
        p.requires_grad_(False)
    slots = list(target_slots(model, targets))
    smallest = min(min(getattr(parent, name).weight.shape) for parent, name in slots)
    if rank > smallest:  # B A is (out, in): its rank cannot exceed min(out, in), the extra columns buy nothing
        warnings.warn(f"LoRA rank {rank} exceeds the smallest adapted layer's {smallest} features: the update's "
                      f"rank stays <= {smallest}; a full fine-tune costs less", stacklevel=2)
    for parent, name in slots:
        setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha, dropout))
    return model


@contextmanager
def adapters_off(model):
    """Within the ``with`` block every adapter of ``model`` is switched off: the model computes its base.

    This is how DPO, GRPO and PPO get their frozen reference policy without a second copy of the model in memory:
    the base weights are frozen, so the base is what the reference was at step 0. Only the ``enabled`` flags
    change, and are restored on exit (also on an exception); ``requires_grad`` and the weights are left alone, and
    it works under ``torch.no_grad()`` as outside it. Yields ``model``.

    Raises:
        ValueError: an adapter is merged into its weight (its base is no longer there to compute): unmerge first.
    """
    layers = lora_layers(model)
    if any(layer.merged for layer in layers):
        raise ValueError("merged LoRA adapters cannot be switched off; unmerge them first")
    before = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer, enabled in zip(layers, before):
            layer.enabled = enabled


class AdaptersOff(nn.Module):
    """The frozen reference of an adapted policy, without a copy: ``model``'s forward with its adapters off
    (``adapters_off``), in eval mode and without gradients, whatever mode the policy is in.

    Its base weights are frozen, so the base is the policy at step 0, the very reference DPO, GRPO and PPO need: the
    same log-probs as a separate frozen copy (tests/test_lora.py), for the memory of no second model. ``model`` is
    kept out of this module's parameters (it is not a submodule): a state dict or a digest of the reference holds
    nothing of its own, ``.to()`` and ``.eval()`` leave the policy alone, and an optimizer never sees it twice.

    Args:
        model: a ``GPTModel`` with LoRA adapters (``add_lora``), unmerged.
    """

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "model", model)  # a plain attribute, not a registered submodule

    @property
    def cfg(self):
        return self.model.cfg

    def forward(self, *args, **kwargs):
        was_training = self.model.training
        self.model.eval()  # dropout off, as in a reference copy kept in eval mode
        try:
            with torch.no_grad(), adapters_off(self.model):
                return self.model(*args, **kwargs)
        finally:
            self.model.train(was_training)


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, by state-dict name: ``trf_blocks.{i}.{target}.lora_A`` (r, in) and ``.lora_B``
    (out, r) (``backbone.``-prefixed in a reward model). Detached, sharing memory with the model."""
    return {name: p.detach() for name, p in unwrap_compiled(model).named_parameters()
            if name.endswith((".lora_A", ".lora_B"))}


def load_lora_state_dict(model, state: dict) -> None:
    """Copy adapter tensors (``lora_state_dict``'s names) into ``model``'s adapters, strictly.

    Raises:
        ValueError: names missing from ``state`` or unexpected in it (the first few of each are named), a shape
            that differs, or a merged adapter (its weight would no longer match).
    """
    own = lora_state_dict(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"the adapter tensors do not match the model's adapters: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    bad = next((name for name in own if own[name].shape != state[name].shape), None)
    if bad is not None:
        raise ValueError(f"adapter tensor {bad} has shape {tuple(state[bad].shape)}, the model's "
                         f"{tuple(own[bad].shape)}")
    if any(layer.merged for layer in lora_layers(model)):
        raise ValueError("cannot load adapter tensors into merged adapters; unmerge them first")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def lora_settings(model) -> dict:
    """``{"rank": r, "alpha": alpha, "targets": [...], "dropout": p}`` of ``model``'s adapters, read off its layers
    (targets in ``LORA_TARGETS`` order). Raises ``ValueError`` if it has none."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    block = gpt_of(model).trf_blocks[0]
    targets = [target for target in LORA_TARGETS if isinstance(block.get_submodule(target), LoRALinear)]
    first = layers[0]
    return {"rank": first.rank, "alpha": first.alpha, "targets": targets, "dropout": first.lora_dropout.p}


def merge_lora(model):
    """Merge every adapter into its weight and put a plain ``Linear`` back in its place; in place, returns ``model``.

    The result is an ordinary ``GPTModel`` (or ``RewardModel``) again: its state dict has exactly a plain model's
    names, its outputs equal the adapted model's up to float32 rounding, and every parameter is trainable, as in a
    freshly built model. A model without adapters is returned unchanged but for that last point.
    """
    for parent, name in target_slots(model):
        layer = getattr(parent, name)
        if isinstance(layer, LoRALinear):
            if not layer.merged:
                layer.merge()
            plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
            plain.weight, plain.bias = layer.weight, layer.bias  # the merged Parameters themselves
            setattr(parent, name, plain.train(layer.training))
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def trainable_parameters(model) -> int:
    """The number of parameters that receive gradients (a tied tensor counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
