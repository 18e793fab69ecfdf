"""The pieces of the Accelerate training loop that every stage shares.

* ``make_accelerator``: devices, mixed precision and processes come from ``accelerate launch`` (or plain python).
* ``make_optimizer`` / ``lr_at``: AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter 2019),
  linear warm-up then cosine decay to 10% (as in GPT-3's recipe); or Muon for the Transformer blocks' matrices
  with AdamW for the rest (``MuonAdamW``, as nanochat and the modded-nanogpt speedrun train).
* ``BatchSchedule``: which examples make up each micro-batch of each step on each process. The data position is
  a pure function of (seed, step), so resuming at step s continues exactly where the run stopped, and N processes
  with batch b see the same global batches as one process with batch N*b.
* ``save_training_state`` / ``load_training_state``: optimizer, step and RNG in safetensors + JSON (no pickle).
* ``StopSignal``: Ctrl-C / SIGTERM finish the current step, save a resumable state, then exit.
* ``MetricsLog``: metrics.jsonl rows and the curves PNG; ``markdown_table`` for the samples tables.
* ``evaluate_lm``: mean next-token loss over a validation set, split over processes.
* ``StageRun``: the plumbing every stage shares (resume, the step loop and its bar, the optimizer step, the loss
  check that all processes agree on, saves, the closing message), so each stage script keeps only its own story.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from contextlib import ExitStack

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from checkpoint import command_line, load_weights_into, save_checkpoint
import cli
from cli import UserError


def make_accelerator(args):
    """An ``accelerate.Accelerator`` for this run, with every RNG seeded from ``args.seed``.

    Mixed precision, device and process count come from ``accelerate launch`` / ``accelerate config``. Several
    processes on a machine without a GPU (``accelerate launch --multi_gpu --num_processes 2`` or ``torchrun``)
    train on the CPU with the gloo backend. Gradient
    accumulation is Accelerate's: inside ``accelerator.accumulate`` the loss is divided by the number of
    micro-batches exactly once (in ``accelerator.backward``) and gradients sync on the last micro-batch.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    # torchrun-style processes with no GPU: tell Accelerate to join them on the CPU instead of running N copies
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=pick_mixed_precision(args.mixed_precision))
    set_seed(args.seed)
    cores = os.cpu_count() or 1
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # set by `accelerate launch`
    if (launched and accelerator.device.type == "cpu" and accelerator.num_processes == 1 and cores > 1
            and torch.get_num_threads() == 1 and os.environ.get("OMP_NUM_THREADS") == "1"):
        # `accelerate launch` without --cpu sets OMP_NUM_THREADS=1 on a machine with no GPU: half speed or worse
        accelerator.print(f"note: this run computes on 1 of {cores} CPU cores (OMP_NUM_THREADS=1, which `accelerate "
                          f"launch` sets unless given --cpu); launch with --cpu or "
                          f"--num_cpu_threads_per_process {cores}")
    return accelerator


def native_bf16() -> bool:
    """True where bf16 matmuls run natively: a CUDA GPU that supports bf16, or a CPU whose flags include
    AVX512-BF16 or AMX-BF16 (Linux ``/proc/cpuinfo``; elsewhere False). Without them bf16 is emulated and slower."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_mixed_precision(choice: str) -> str:
    """``--mixed_precision``: an explicit "no"/"bf16"/"fp16" wins. "auto" keeps what ``accelerate launch`` was
    given (it always sets ``ACCELERATE_MIXED_PRECISION``, from its flag or its config); a stage run with plain
    ``python`` gets bf16 where ``native_bf16()``, else "no" (fp32)."""
    if choice != "auto":
        return choice
    return os.environ.get("ACCELERATE_MIXED_PRECISION") or ("bf16" if native_bf16() else "no")


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
    Transformer blocks (attention and MLP matrices) form a Muon group (``"muon": True``) whose learning rate is ``muon_lr_scale`` times the
    schedule's, decayed by ``weight_decay``; the token embedding (and the head tied to it) is an AdamW group at
    ``embedding_lr_scale`` times the schedule's; an untied head is decayed like the matrices in ``make_optimizer``;
    positions, norms and biases are not decayed. Without ``muon`` the block matrices are a decayed AdamW group."""
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

    ``Muon`` replaces each 2-D weight's momentum-SGD update by its nearest semi-orthogonal matrix (5
    Newton-Schulz iterations), scaled by ``sqrt(max(1, rows / cols))``; nanochat and the modded-nanogpt speedrun
    train the hidden matrices with it and the embeddings, head and gains with AdamW, as here. Both inner optimizers share this object's
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


class BatchSchedule:
    """Deterministic data order: epoch ``e`` visits the examples in ``randperm(n)`` seeded by ``seed + e``.

    Global step ``s`` consumes ``batch_size * accumulation * num_processes`` consecutive examples of that endless
    stream; micro-batch ``m`` of process ``r`` takes its own consecutive ``batch_size`` of them.
    """

    def __init__(self, num_examples: int, batch_size: int, accumulation: int, num_processes: int, seed: int):
        if num_examples <= 0:
            raise UserError("the training set is empty; check the data files")
        self.n, self.b, self.acc, self.world, self.seed = num_examples, batch_size, accumulation, num_processes, seed
        self._epoch, self._perm = None, None

    @property
    def global_batch_size(self) -> int:
        return self.b * self.acc * self.world

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        first = step * self.global_batch_size + (micro * self.world + rank) * self.b
        return [self._example(k) for k in range(first, first + self.b)]

    def _example(self, k: int) -> int:
        epoch, pos = divmod(k, self.n)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=generator).tolist()
        return self._perm[pos]


def save_training_state(state_dir: str, optimizer, trainer_state: dict, rng_states) -> None:
    """Write the optimizer, the trainer's counters and every process's RNG state under ``state_dir``.

    Tensors go to safetensors, everything else to JSON, so loading never unpickles anything.
    ``rng_states`` is a (num_processes, n) uint8 tensor from ``gather_rng_states``.
    """
    os.makedirs(state_dir, exist_ok=True)
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for param_id, slots in sd["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{param_id}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{param_id}.{name}"] = value
    save_file(tensors, os.path.join(state_dir, "optimizer.safetensors"))
    save_file({"torch_rng": rng_states.cpu().contiguous()}, os.path.join(state_dir, "rng.safetensors"))
    with open(os.path.join(state_dir, "trainer_state.json"), "w", encoding="utf-8") as f:
        json.dump({"trainer": trainer_state, "param_groups": sd["param_groups"], "scalars": scalars}, f, indent=1)


# Flags that may differ between a run and its --resume: they decide when to stop, save or overwrite, not what the
# run computes.
RESUME_FREE = ("resume", "stop_after", "save_every", "overwrite")


def run_settings(args) -> dict:
    """The settings of a run that a ``--resume`` must repeat for the result to be the run that was saved: every
    number, bool and word among the parsed arguments (paths are left out: the same file may be named from another
    folder), except ``RESUME_FREE``."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RESUME_FREE
            and (v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and os.sep not in v))}


def check_same_settings(saved: dict | None, now: dict, output_dir: str) -> None:
    """``UserError`` naming each flag whose value differs from the saved run's (a state saved before settings were
    recorded is not checked)."""
    if saved is None:
        return
    differ = [k for k in saved if k in now and saved[k] != now[k]]
    if differ:
        was = " ".join(f"--{k} {saved[k]}" for k in differ)
        given = ", ".join(f"--{k} {now[k]}" for k in differ)
        raise UserError(f"--resume: the run in {output_dir} was saved with {was}, not {given}; resume it with "
                        f"the same flags, or start a new run with --overwrite")


def resume_command() -> str:
    """This run's command line with ``--resume`` added once: what continues it."""
    command = command_line()
    return command if " --resume " in f" {command} " else f"{command} --resume"


def load_training_state(state_dir: str, optimizer, accelerator) -> dict:
    """Restore what ``save_training_state`` wrote; returns the trainer's counters (step, tokens_seen, ...).

    Raises:
        UserError: files missing or damaged, or the state was saved by a different number of processes.
    """
    try:
        with open(os.path.join(state_dir, "trainer_state.json"), encoding="utf-8") as f:
            saved = json.load(f)
        tensors = load_file(os.path.join(state_dir, "optimizer.safetensors"))
        rng = load_file(os.path.join(state_dir, "rng.safetensors"))["torch_rng"]
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the training state in {state_dir} ({e}); start again without --resume") from e
    state = {}
    for key, value in list(tensors.items()) + list(saved["scalars"].items()):
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    try:
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    except (ValueError, KeyError) as e:
        raise UserError(f"the optimizer state in {state_dir} does not fit this model ({e}); "
                        f"resume with the same --preset and --optimizer as the run that saved it, or start again "
                        f"without --resume") from e
    if rng.shape[0] != accelerator.num_processes:
        raise UserError(f"{state_dir} was saved by {rng.shape[0]} process(es) but this run has "
                        f"{accelerator.num_processes}; resume with the same number of processes")
    torch.set_rng_state(rng[accelerator.process_index].clone())
    return saved["trainer"]


def gather_rng_states(accelerator) -> torch.Tensor:
    """Every process's torch RNG state, stacked: (num_processes, n) uint8. All processes must call it."""
    state = torch.get_rng_state()[None]  # (1, n)
    if accelerator.num_processes == 1:
        return state
    return accelerator.gather(state.to(accelerator.device)).cpu()


def mean_over_processes(accelerator, values):
    """The mean of each float in ``values`` over all processes (all must call); a list of floats."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        tensor = accelerator.reduce(tensor, reduction="mean")
    return tensor.tolist()


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps, so the step finishes and a resumable state
    is saved. A second Ctrl-C stops at once."""

    def __init__(self):
        self.signum = None

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self, accelerator) -> bool:
        """True on every process as soon as any process got a signal (all processes must call it each step)."""
        flag = torch.tensor([1.0 if self.signum is not None else 0.0], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="sum")
        return bool(flag.item() > 0)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


class MetricsLog:
    """Rows of metrics, one JSON object per line in ``metrics.jsonl``; ``plot`` draws every numeric series."""

    def __init__(self, rows=None):
        self.rows = list(rows or [])

    @classmethod
    def resume(cls, path: str, up_to_step: int) -> "MetricsLog":
        rows = []
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                rows = [r for r in map(json.loads, f) if r.get("step", 0) <= up_to_step]
        return cls(rows)

    def add(self, **row) -> dict:
        row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
        self.rows.append(row)
        return row

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def plot(self, path: str, title: str, keys=None) -> None:
        """One panel per metric (x = step), up to four panels a row, saved as PNG. ``keys`` defaults to every
        numeric field but step; a tuple of keys draws those series in one panel (e.g. a training and a held-out
        value of the same quantity)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = keys or sorted({k for r in self.rows for k, v in r.items()
                               if isinstance(v, (int, float)) and k not in ("step", "tokens_seen", "lr", "time_s")})
        panels = [[k for k in ((key,) if isinstance(key, str) else key) if any(k in r for r in self.rows)]
                  for key in keys]
        panels = [p for p in panels if p]
        if not panels:
            return
        cols = min(4, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
        for ax, series in zip(axes.flat, panels):
            for key in series:
                points = [(r["step"], r[key]) for r in self.rows if key in r and r[key] is not None]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 40 else None,
                        label=key)
            ax.set_title(" / ".join(series))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if len(series) > 1:
                ax.legend(fontsize="small")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


@torch.no_grad()
def evaluate_lm(model, examples, collate, batch_size: int, accelerator) -> float:
    """Mean next-token cross-entropy (nats per predicted token) over ``examples``, shared across processes.

    ``collate(list_of_examples)`` must give ``input_ids``, ``labels`` (-100 ignored) and optionally
    ``attention_mask``; each process takes every ``num_processes``-th example.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=accelerator.device)  # (sum of losses, number of predicted tokens)
    mine = examples[accelerator.process_index::accelerator.num_processes]
    for start in range(0, len(mine), batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start:start + batch_size]).items()}
        count = (batch["labels"] != -100).sum()
        if not count:
            continue  # nothing to predict in this batch (its mean loss would be NaN)
        with accelerator.autocast():
            loss = model(batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"])["loss"]
        total[0] += loss * count
        total[1] += count
    total = accelerator.reduce(total, reduction="sum") if accelerator.num_processes > 1 else total
    model.train(was_training)
    return (total[0] / total[1].clamp(min=1)).item()


def spread_subset(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)`` (a fixed evaluation subset)."""
    k = min(n, k)
    return [i * n // k for i in range(k)]


def markdown_table(headers, rows) -> str:
    """A Markdown table: one header row, then one row per item of ``rows`` (each a sequence of cells).
    ``|`` is escaped and newlines become ``<br>``, so every cell stays in its column."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


class StageRun:
    """Everything a training stage does besides its own maths, written once.

    A stage builds its data, model and optimizer, hands them to ``StageRun``, and keeps its forward pass, loss and
    evaluation inline in its own loop. ``StageRun`` owns:

    * resume: with ``--resume``, the constructor loads the saved weights, optimizer, RNG, counters and metrics;
    * ``steps()``: the loop over optimizer steps with the progress bar and the learning-rate schedule
      (``lr_at``); after each step it saves a resumable checkpoint on Ctrl-C/SIGTERM (then ends the loop) or
      every ``--save_every`` steps;
    * ``accumulate()`` + ``backward(loss)``: one micro-batch under ``accelerator.accumulate`` and autocast, then
      backward, clipping and the optimizer step (which Accelerate skips until the last micro-batch);
    * ``end_step(loss, tokens)``: the loss averaged over processes and checked on every process alike, so a
      non-finite loss on one process stops them all with the same error instead of leaving the others waiting
      in the next collective; the step and token counters;
    * ``log(row)``: one ``metrics.jsonl`` row with step, the learning rate, tokens_seen and seconds;
    * ``save(final)`` / ``finish(summary)``: the checkpoint (atomic, see ``checkpoint.save_checkpoint``) with
      metrics, the curves PNG, the stage's extra files and, unless final, ``state/``; the closing message.

    It is not a trainer: it never calls the model, and it knows nothing of what a stage's batch holds.

    Args:
        stage: the stage's name, stored in ``config.json`` ("pretrain", "sft", ...).
        args: the parsed arguments (``output_dir``, ``resume``, ``max_steps``, ``stop_after``, ``save_every``,
            ``eval_every``, ``max_grad_norm``).
        model, optimizer: as returned by ``accelerator.prepare``.
        saved: the module whose weights the checkpoint holds (default: the unwrapped ``model``).
        meta: what ``config.json`` records besides the counters (the parent, stage options).
        plot: (file name, metric keys) of the curves PNG written with the final checkpoint.
        extra: JSON counters the stage updates and that resume restores (e.g. PPO's ``kl_coef``).
        write_state: an optional ``fn(state_dir)`` saving more resumable tensors (e.g. PPO's critic).
    """

    def __init__(self, stage: str, args, accelerator, model, optimizer, tokenizer, meta: dict, plot, saved=None,
                 extra: dict | None = None, write_state=None):
        self.stage, self.args, self.accelerator = stage, args, accelerator
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer
        self.saved = saved if saved is not None else accelerator.unwrap_model(model)
        self.meta, self.plot, self.extra, self.write_state = meta, plot, dict(extra or {}), write_state
        self.step, self.tokens_seen, self.metrics = 0, 0, MetricsLog()
        self.results = {}  # final metrics for config.json beside the latest val_* values
        self.files = {}  # {file name: fn(path)}: the stage's own files (e.g. samples.md), written at each save
        self.exit_code = None  # set when Ctrl-C/SIGTERM ended the loop
        self.lr = None  # the learning rate of the current step, set by steps()
        self.started = time.time()
        self._bar, self._tokens_at, self._time_at = None, 0, time.perf_counter()
        if args.resume:
            self._resume()

    @property
    def completed(self) -> bool:
        """True once the last step has run, unless Ctrl-C came at it (then the run is resumed, not finished)."""
        return self.step >= self.args.max_steps and self.exit_code is None

    @property
    def eval_due(self) -> bool:
        """True after a step that ends a ``--eval_every`` period or the run."""
        return self.step % self.args.eval_every == 0 or self.step == self.args.max_steps

    def _resume(self) -> None:
        """Load the weights, optimizer, RNG, counters and metrics saved in ``--output_dir``; refuse (``UserError``)
        when this run's settings differ from the saved run's, which would make a different run than the one saved."""
        load_weights_into(self.saved, self.args.output_dir)
        trainer = load_training_state(os.path.join(self.args.output_dir, "state"), self.optimizer, self.accelerator)
        check_same_settings(trainer.get("settings"), run_settings(self.args), self.args.output_dir)
        self.step, self.tokens_seen = trainer["step"], trainer.get("tokens_seen", 0)
        self._tokens_at = self.tokens_seen  # tokens/s counts from here
        self.extra.update({k: trainer[k] for k in self.extra if k in trainer})
        self.metrics = MetricsLog.resume(os.path.join(self.args.output_dir, "metrics.jsonl"), self.step)
        if self.metrics.rows:  # time_s goes on from the saved run's, as tokens_seen does (tokens/s stays true)
            self.started -= self.metrics.rows[-1].get("time_s", 0.0)
        self.accelerator.print(f"resumed at step {self.step}")

    def steps(self):
        """Yield the 0-based index of each optimizer step still to run (up to ``--max_steps``, or ``--stop_after``
        more); the body must call ``end_step``. All processes must iterate alike."""
        args = self.args
        last = min(args.max_steps, self.step + args.stop_after) if args.stop_after else args.max_steps
        self._bar = tqdm(total=args.max_steps, initial=self.step, desc=self.stage, dynamic_ncols=True,
                         disable=not self.accelerator.is_main_process)
        with StopSignal() as stop:
            while self.step < last:
                # linear warm-up then cosine decay, set before the step (the schedule is every stage's)
                self.lr = lr_at(self.step, args.learning_rate, args.warmup_steps, args.max_steps)
                set_lr(self.optimizer, self.lr)
                yield self.step
                if stop.requested(self.accelerator):
                    self.save(final=False)
                    self.print(f"interrupted at step {self.step}; state saved in {args.output_dir}. Continue with: "
                               f"{resume_command()}")
                    self.exit_code = stop.exit_code
                    break
                if args.save_every and self.step % args.save_every == 0 and self.step < args.max_steps:
                    self.save(final=False)
        self._bar.close()

    def accumulate(self):
        """The context of one micro-batch: gradient accumulation (and DDP's gradient sync) plus autocast."""
        stack = ExitStack()
        stack.enter_context(self.accelerator.accumulate(self.model))
        stack.enter_context(self.accelerator.autocast())
        return stack

    def backward(self, loss) -> None:
        """Backward (Accelerate divides by the accumulation steps once), then on the last micro-batch of the step
        clip the gradient norm to ``--max_grad_norm``, step the optimizer and zero the gradients."""
        self.accelerator.backward(loss)
        if self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()  # Accelerate's optimizer steps only once the gradients are synced
        self.optimizer.zero_grad()

    def end_step(self, loss: float, tokens: int = 0) -> float:
        """Close a step: ``loss`` (this process's mean over its micro-batches) averaged over processes and
        ``tokens`` (real tokens this process read) summed, in one collective; then the counters and the bar.

        Raises:
            UserError: on every process alike, when the loss is not finite on any of them.
        """
        values = torch.tensor([loss, float(tokens)], dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            values = self.accelerator.reduce(values, reduction="sum")  # NaN or inf anywhere makes the sum non-finite
        loss, tokens = values[0].item() / self.accelerator.num_processes, int(values[1].item())
        if not math.isfinite(loss):
            raise UserError(f"the training loss became {loss} at step {self.step + 1}; the last good checkpoint "
                            f"(if any) is in {self.args.output_dir}; lower --learning_rate and start again")
        self.step += 1
        self.tokens_seen += tokens
        self._bar.update(1)
        return loss

    def log(self, row: dict, show=()) -> dict:
        """Add a metrics row for the current step (``step``, ``lr``, ``tokens_seen`` and ``time_s`` are filled in) and
        show the keys ``show`` and the tokens per second since the last row on the bar."""
        lr = {"lr": self.lr} if self.lr is not None and self.step > 0 else {}
        row = self.metrics.add(step=self.step, **row, **lr, tokens_seen=self.tokens_seen,
                               time_s=round(time.time() - self.started, 1))
        if self._bar is not None and self.step > 0:
            now = time.perf_counter()
            rate = (self.tokens_seen - self._tokens_at) / max(now - self._time_at, 1e-9)
            self._tokens_at, self._time_at = self.tokens_seen, now
            postfix = {k: (f"{row[k]:.3g}" if isinstance(row[k], float) else row[k]) for k in show if k in row}
            self._bar.set_postfix(**postfix, **({"tok_s": f"{rate:.0f}"} if rate else {}))
        return row

    def print(self, message: str) -> None:
        """Print on the main process only, above the progress bar."""
        if self.accelerator.is_main_process:
            (self._bar.write if self._bar is not None else print)(message)

    def latest_val(self) -> dict:
        """The ``val_*`` values of the latest row that has any."""
        last = next((r for r in reversed(self.metrics.rows) if any(k.startswith("val_") for k in r)), {})
        return {k: v for k, v in last.items() if k.startswith("val_") and isinstance(v, (int, float))}

    def save(self, final: bool) -> None:
        """Write the checkpoint: weights, config (with ``meta``, counters and metrics), tokenizer, metrics.jsonl,
        the stage's ``files``, the curves PNG if ``final``, and otherwise the resumable ``state/``. All processes
        must call it (the RNG states are gathered)."""
        rng = gather_rng_states(self.accelerator)
        if self.accelerator.is_main_process:
            files = {"metrics.jsonl": self.metrics.write, **self.files}
            if final:
                name, keys = self.plot
                files[name] = lambda path: self.metrics.plot(path, self.stage, keys)
            counters = {"step": self.step, "tokens_seen": self.tokens_seen, **self.extra}
            meta = {"stage": self.stage, **self.meta, **counters, "mixed_precision": self.accelerator.mixed_precision,
                    "metrics": {**self.latest_val(), **self.results}, "command": command_line()}

            def write_state(state_dir):
                save_training_state(state_dir, self.optimizer, {**counters, "settings": run_settings(self.args)}, rng)
                if self.write_state is not None:
                    self.write_state(state_dir)

            save_checkpoint(self.args.output_dir, self.saved, self.tokenizer, meta, None if final else write_state,
                            files)
        self.accelerator.wait_for_everyone()

    def save_before_final_evaluation(self) -> None:
        """Save a resumable state after the last step, before the evaluation that follows it (the test split, the
        held-out monitors), so that a Ctrl-C there keeps the trained steps: ``--resume`` then runs only that
        evaluation. All processes must call it."""
        self.save(final=False)
        cli.interrupt_hint = (f"the trained steps are saved in {self.args.output_dir}; run the final evaluation "
                              f"with: {resume_command()}")

    def finish(self, summary: str = "") -> int:
        """End the stage and return its exit code: after Ctrl-C the signal's (the state is already saved); after
        ``--stop_after`` a resumable checkpoint; after the last step the final one and the closing message."""
        if self.exit_code is not None:
            return self.exit_code
        if not self.completed:
            self.save(final=False)
            self.accelerator.print(f"stopped after step {self.step} of {self.args.max_steps}; continue with: "
                                   f"{resume_command()}")
            return 0
        self.save(final=True)
        cli.interrupt_hint = None  # nothing is left to resume
        self.accelerator.print(f"saved {self.args.output_dir} (step {self.step}, {self.tokens_seen:,} tokens, "
                               f"{summary + ', ' if summary else ''}{time.time() - self.started:.0f} s)")
        return 0
