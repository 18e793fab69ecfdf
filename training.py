"""The pieces of the Accelerate training loop that every stage shares.

* ``make_accelerator``: devices, mixed precision and processes come from ``accelerate launch`` (or plain python).
* ``make_optimizer`` / ``lr_at``: AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter 2019),
  linear warm-up then cosine decay to 10% (as in GPT-3's recipe).
* ``BatchSchedule``: which examples make up each micro-batch of each step on each process. The data position is
  a pure function of (seed, step), so resuming at step s continues exactly where the run stopped, and N processes
  with batch b see the same global batches as one process with batch N*b.
* ``save_training_state`` / ``load_training_state``: optimizer, step and RNG in safetensors + JSON (no pickle).
* ``StopSignal``: Ctrl-C / SIGTERM finish the current step, save a resumable state, then exit.
* ``MetricsLog``: metrics.jsonl rows and the curves PNG.
* ``evaluate_lm``: mean next-token loss over a validation set, split over processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

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
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=args.gradient_accumulation_steps)
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


def make_optimizer(model: nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices of Linear layers only; biases, norm scales/shifts and
    embeddings (and the head tied to them) are not decayed."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # the fused kernel updates all parameters in one pass (the per-tensor loop costs seconds a step on a CPU)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=True)


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
                        f"resume with the same --preset, or start again without --resume") from e
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


def save_between_steps(stop: "StopSignal", accelerator, step: int, args, save_resumable) -> int | None:
    """What every stage does after a step: on Ctrl-C/SIGTERM, save a resumable state, print how to resume and
    return the exit code (128 + the signal); otherwise save every ``--save_every`` steps and return None.
    ``save_resumable()`` writes the checkpoint with its ``state/``. All processes must call it."""
    from checkpoint import command_line

    if stop.requested(accelerator):
        save_resumable()
        accelerator.print(f"interrupted at step {step}; state saved in {args.output_dir}. Continue with: "
                          f"{command_line()} --resume")
        return stop.exit_code
    if args.save_every and step % args.save_every == 0 and step < args.max_steps:
        save_resumable()
    return None


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
        """One panel per metric (x = step), saved as PNG. ``keys`` defaults to every numeric field but step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = keys or sorted({k for r in self.rows for k, v in r.items()
                               if isinstance(v, (int, float)) and k not in ("step", "tokens_seen", "lr", "time_s")})
        keys = [k for k in keys if any(k in r for r in self.rows)]
        if not keys:
            return
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
        for ax, key in zip(axes[0], keys):
            points = [(r["step"], r[key]) for r in self.rows if key in r and r[key] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 40 else None)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
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


class Throughput:
    """Tokens per second over the steps since the last ``rate`` call."""

    def __init__(self):
        self.t0, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        value = self.tokens / max(now - self.t0, 1e-9)
        self.t0, self.tokens = now, 0
        return value
