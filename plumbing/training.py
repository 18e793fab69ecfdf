"""The pieces of the Accelerate training loop that every stage shares.

* ``make_accelerator``: devices, mixed precision and processes come from ``accelerate launch`` (or plain python).
* ``save_training_state`` / ``load_training_state``: optimizer, step and RNG in safetensors + JSON (no pickle);
  ``run_settings`` / ``check_same_settings``: a ``--resume`` must repeat the saved run's settings.
* ``StopSignal``: Ctrl-C / SIGTERM finish the current step, save a resumable state, then exit.
* ``MetricsLog``: metrics.jsonl rows and the curves PNG; ``Curves``: the same rows in the tracker ``--report_to``
  names (TensorBoard by default), each value once, a resumed run's included.
* ``evaluate_lm``: mean next-token loss over a validation set, split over processes.
* ``StageRun``: the plumbing every stage shares (resume, the step loop and its bar, the optimizer step, the loss
  check that all processes agree on, saves, the closing message), so each stage script keeps only its own story.

The optimizers live in ``optimizers.py``, the data order (``BatchSchedule``) in ``batching.py``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import time
from collections import Counter
from contextlib import ExitStack

import torch
from accelerate.utils import gather_object
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from plumbing import cli
from plumbing.checkpoint import command_line, load_weights_into, save_checkpoint
from plumbing.cli import UserError
from plumbing.devices import pick_mixed_precision
from plumbing.flops import FlopCounter, device_name, format_utilisation, peak_flops, speed_record, utilisation


def make_accelerator(args):
    """An ``accelerate.Accelerator`` for this run, with every RNG seeded from ``args.seed``.

    ``--deterministic`` turns on PyTorch's deterministic kernels (what a bit-identical ``--resume`` needs on a
    GPU; on a CPU every run already is). ``--compile`` has ``prepare`` wrap the model in ``torch.compile``.
    Mixed precision, device and process count come from ``accelerate launch`` / ``accelerate config``. Several
    processes on a machine without a GPU (``accelerate launch --multi_gpu --num_processes 2`` or ``torchrun``)
    train on the CPU with the gloo backend. Gradient
    accumulation is Accelerate's: inside ``accelerator.accumulate`` the loss is divided by the number of
    micro-batches exactly once (in ``accelerator.backward``) and gradients sync on the last micro-batch.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if args.deterministic and torch.cuda.is_available():  # a CPU run repeats itself without it: nothing to change
        # cuBLAS keeps one reduction order only with a fixed workspace (read when its first handle is made); the
        # scatters and index writes take their deterministic kernels; an operation that has none warns (warn_only)
        # instead of stopping the run. The fused attention kernels' backward stays non-deterministic under
        # warn_only, so attention runs PyTorch's math kernel (slower, deterministic).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)

    # torchrun-style processes with no GPU: tell Accelerate to join them on the CPU instead of running N copies
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    # --compile: accelerate.prepare wraps the model in torch.compile; without it `accelerate launch
    # --dynamo_backend` still decides (None reads its setting)
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=pick_mixed_precision(args.mixed_precision),
                              dynamo_backend="inductor" if args.compile else None,
                              log_with=tracker_of(args), project_dir=args.output_dir)
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


def tracker_of(args) -> str | None:
    """The Accelerate tracker ``--report_to`` names (None for "none"); ``UserError`` when its package is missing."""
    if getattr(args, "report_to", "none") == "none":  # args made by hand (a test's) may not have it
        return None
    if importlib.util.find_spec(args.report_to) is None:  # tensorboard, wandb and trackio: package = tracker name
        raise UserError(f"--report_to {args.report_to}: the {args.report_to} package is not installed; install it "
                        f"(pip install {args.report_to}) or pass --report_to none")
    return args.report_to


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


# Flags that may differ between a run and its --resume: they decide when to stop, save or overwrite, or where the
# curves go, not what the run computes.
RESUME_FREE = ("resume", "stop_after", "save_every", "overwrite", "report_to")


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

    def flag(key, value):  # as typed: "--compile" or "no --compile" for a switch, "--seed 3" for a value
        return (f"--{key}" if value else f"no --{key}") if isinstance(value, bool) else f"--{key} {value}"

    if differ:
        was = " ".join(flag(k, saved[k]) for k in differ)
        given = ", ".join(flag(k, now[k]) for k in differ)
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
    mine, cpu_size = rng[accelerator.process_index], torch.get_rng_state().numel()
    torch.set_rng_state(mine[:cpu_size].clone())
    if accelerator.device.type == "cuda" and mine.numel() > cpu_size:  # the GPU's generator, saved by a GPU run
        torch.cuda.set_rng_state(mine[cpu_size:].clone(), accelerator.device)
    return saved["trainer"]


def gather_rng_states(accelerator) -> torch.Tensor:
    """Every process's torch RNG state, stacked: (num_processes, n) uint8, the CPU generator's state followed, on
    a GPU, by the device generator's (dropout and sampling on a GPU draw from it). All processes must call it."""
    state = torch.get_rng_state()  # (n_cpu,)
    if accelerator.device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(accelerator.device)])  # (n_cpu + n_cuda,)
    state = state[None]  # (1, n)
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
        if accelerator.num_processes == 1:  # nothing to agree on: no tensor, so no wait for the GPU
            return self.signum is not None
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
    def resume(cls, path: str, up_to_step: int) -> MetricsLog:
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


# the run folder's entry that holds the TensorBoard event files (Accelerate's tracker writes into project_dir/<name>)
CURVES_DIR = "tensorboard"
# the wandb or trackio project every stage logs into, each stage a run named after it
TRACKER_PROJECT = "handmade-gpt2-zh"


class Curves:
    """The ``metrics.jsonl`` rows as curves in the tracker ``--report_to`` names, through Accelerate's trackers
    (``accelerator.init_trackers``, ``log``, each tracker's ``finish``): every number of every row, at its row's step,
    once.

    ``send(rows)`` logs what it has not logged before: the rows added since, and values added later to a row already
    sent (the final held-out monitors join the last row). TensorBoard writes its event files into
    ``--output_dir/tensorboard``, which each save carries into the new checkpoint folder (``replace_dir``'s
    ``carry``), so the writer keeps its file. Every run starts that folder anew, whatever it logs to: a new run
    (``--overwrite``) drops the old run's curves; a resumed one writes the rows it kept (those up to its saved step)
    again before going on, so the steps a stopped run logged after its last save are not there twice. wandb and
    trackio get one project (``TRACKER_PROJECT``) with a run per stage; a resume starts a new run there, which holds
    the kept rows and what follows (the stopped run stays as it was).
    """

    def __init__(self, accelerator, args, rows, stage: str = "stage"):
        report_to = getattr(args, "report_to", "none")  # args made by hand (a test's) may have none: no curves
        self.accelerator, self.on, self.sent = accelerator, report_to != "none", []
        folder = os.path.join(args.output_dir, CURVES_DIR)
        if accelerator.is_main_process and os.path.isdir(folder):  # only the event files: nothing else is ours
            for name in os.listdir(folder):
                if name.startswith("events.out.tfevents."):
                    os.remove(os.path.join(folder, name))
            if not os.listdir(folder):  # with another tracker or none, no empty folder is left behind
                os.rmdir(folder)
        if not self.on:
            return
        accelerator.wait_for_everyone()
        if report_to == "tensorboard":
            accelerator.init_trackers(CURVES_DIR)
        else:  # wandb and trackio: one project, a run per stage
            accelerator.init_trackers(TRACKER_PROJECT, init_kwargs={report_to: {"name": stage}})
        self.send(rows)

    def send(self, rows) -> None:
        """Log each number of ``rows`` (``MetricsLog.rows``) not logged yet, at its row's ``step``."""
        if not self.on:
            return
        for i, row in enumerate(rows):
            if i == len(self.sent):
                self.sent.append(set())
            new = {k: v for k, v in row.items() if k != "step" and k not in self.sent[i]
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
            if new:
                self.accelerator.log(new, step=row["step"])
                self.sent[i].update(new)

    def close(self) -> None:
        """Flush and close the trackers (what ``accelerator.end_training`` does first; it also ends the process
        group, which a stage may still need after its curves are done)."""
        for tracker in self.accelerator.trackers if self.on else ():
            tracker.finish()


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


class StageRun:
    """Everything a training stage does besides its own maths, written once.

    A stage builds its data, model and optimizer, hands them to ``StageRun``, and keeps its forward pass, loss and
    evaluation inline in its own loop. ``StageRun`` owns:

    * resume: with ``--resume``, the constructor loads the saved weights, optimizer, RNG, counters and metrics;
    * ``steps()``: the loop over optimizer steps with the progress bar (the loop sets each step's learning rate
      itself, in view: ``optimizers.lr_at`` and ``set_lr``); after each step it saves a resumable checkpoint on
      Ctrl-C/SIGTERM (then ends the loop) or every ``--save_every`` steps;
    * ``accumulate()``: the context of one micro-batch, ``accelerator.accumulate`` and autocast; the stage calls
      ``accelerator.backward(loss)`` in it, and after its micro-batches ``clip_gradients()``, which clips the norm
      and says whether the step may be applied, then ``optimizer.step()`` and ``optimizer.zero_grad()``;
    * ``end_step(loss, tokens)``: the loss averaged over processes and checked on every process alike, so a
      non-finite loss on one process stops them all with the same error instead of leaving the others waiting
      in the next collective; the step and token counters;
    * ``log(row)``: one ``metrics.jsonl`` row with step, the learning rate, tokens_seen and seconds, and the FLOP/s
      since the last row (``flop_s``: ``flops.FlopCounter`` counts every pass of the stage's models) with the MFU
      where the device's peak is known (``flops.peak_flops``);
    * ``save(final)`` / ``finish(summary)``: the checkpoint (atomic, see ``checkpoint.save_checkpoint``) with
      metrics, the curves PNG, the stage's extra files and, unless final, ``state/``; the closing message.

    It is not a trainer: it never calls the model, and it knows nothing of what a stage's batch holds.

    Args:
        stage: the stage's name, stored in ``config.json`` ("pretrain", "sft", ...).
        args: the parsed arguments (``output_dir``, ``resume``, ``max_steps``, ``stop_after``, ``save_every``,
            ``eval_every``, ``max_grad_norm``).
        model, optimizer: as returned by ``accelerator.prepare``.
        unwrapped_model: the module whose weights the checkpoint holds (default: ``model`` unwrapped from
            Accelerate's and ``torch.compile``'s wrappers; PPO gives the policy inside its policy-and-critic module).
        meta: what ``config.json`` records besides the counters (the parent, stage options).
        plot: (file name, metric keys) of the curves PNG written with the final checkpoint.
        extra: JSON counters the stage updates and that resume restores (e.g. PPO's ``kl_coef``).
        write_state: an optional ``fn(state_dir)`` saving more resumable tensors (e.g. PPO's critic).
        other_models: the models the stage runs besides ``model`` (a reference, a reward model): their passes count
            in the stage's FLOPs too.
    """

    def __init__(self, stage: str, args, accelerator, model, optimizer, tokenizer, meta: dict, plot,
                 unwrapped_model=None, extra: dict | None = None, write_state=None, other_models=()):
        self.stage, self.args, self.accelerator = stage, args, accelerator
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer
        # the plain module inside Accelerate's (and torch.compile's) wrappers: what is saved, and what generates
        self.unwrapped_model = (unwrapped_model if unwrapped_model is not None
                                else accelerator.unwrap_model(model, keep_torch_compile=False))
        self.meta, self.plot, self.extra, self.write_state = meta, plot, dict(extra or {}), write_state
        self.step, self.tokens_seen, self.metrics = 0, 0, MetricsLog()
        self.results = {}  # final metrics for config.json beside the latest val_* values
        self.files = {}  # {file name: fn(path)}: the stage's own files (e.g. samples.md), written at each save
        self.exit_code = None  # set when Ctrl-C/SIGTERM ended the loop
        self.bad_gradient = None  # the non-finite gradient norm of a step that clip_gradients() held back
        # every pass of every model the stage runs, by kind (this process's); the FLOP/s of all processes is read
        # against the peak of all their devices
        self.flop_counter = FlopCounter(model, *other_models)
        peak = peak_flops(accelerator.device)
        self.peak_flops = peak and peak * accelerator.num_processes
        self.started = time.time()
        self._bar, self._tokens_at, self._time_at, self._flops_at = None, 0, time.perf_counter(), 0
        if args.resume:
            self._resume()
        self.curves = Curves(accelerator, args, self.metrics.rows, stage)  # a resumed run's kept rows first

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
        load_weights_into(self.unwrapped_model, self.args.output_dir)
        trainer = load_training_state(os.path.join(self.args.output_dir, "state"), self.optimizer, self.accelerator)
        check_same_settings(trainer.get("settings"), run_settings(self.args), self.args.output_dir)
        self.step, self.tokens_seen = trainer["step"], trainer.get("tokens_seen", 0)
        self._tokens_at = self.tokens_seen  # tokens/s counts from here
        self.extra.update({k: trainer[k] for k in self.extra if k in trainer})
        if self.accelerator.is_main_process:  # the saved run's FLOPs (of all its processes) go on from here
            self.flop_counter.flops.update(trainer.get("flops", {}))
        self._flops_at = self.flop_counter.total
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

    def clip_gradients(self) -> bool:
        """Clip the gradient norm to ``--max_grad_norm`` once a step's micro-batches are all in, and say whether
        the optimizer may apply the gradients: ``False`` when their norm is not finite. The stage's loop then
        skips ``optimizer.step()`` (the weights stay as they were) and ``end_step`` stops the run with a one-line
        error, so such a gradient is never applied. Before the last micro-batch of a step (Accelerate's
        ``sync_gradients`` is false) it does nothing and says ``True``: Accelerate's optimizer does not step there.

        The norm is of the synced gradients, the same on every process, so all processes skip alike. Under fp16
        Accelerate's loss scaler skips an overflowing step itself and lowers its scale: no error then."""
        if not self.accelerator.sync_gradients:
            return True
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        if norm is not None and self.accelerator.scaler is None and not torch.isfinite(torch.as_tensor(norm)):
            self.bad_gradient = float(norm)
            return False
        return True

    def end_step(self, loss: float, tokens: int = 0) -> float:
        """Close a step: ``loss`` (this process's mean over its micro-batches) averaged over processes and
        ``tokens`` (real tokens this process read) summed, in one collective; then the counters and the bar.

        Raises:
            UserError: on every process alike, when the loss is not finite on any of them, or when
                ``clip_gradients`` held back a step whose gradient was not finite.
        """
        if self.accelerator.num_processes > 1:
            values = torch.tensor([loss, float(tokens)], dtype=torch.float64, device=self.accelerator.device)
            values = self.accelerator.reduce(values, reduction="sum")  # NaN or inf anywhere makes the sum non-finite
            loss, tokens = values[0].item() / self.accelerator.num_processes, int(values[1].item())
        if not math.isfinite(loss):
            raise UserError(f"the training loss became {loss} at step {self.step + 1}; the last good checkpoint "
                            f"(if any) is in {self.args.output_dir}; lower --learning_rate and start again")
        if self.bad_gradient is not None:
            raise UserError(f"the gradient norm became {self.bad_gradient} at step {self.step + 1} (the loss was "
                            f"{loss:.4g}); that step was not applied; the last good checkpoint (if any) is in "
                            f"{self.args.output_dir}; lower --learning_rate and start again")
        self.step += 1
        self.tokens_seen += tokens
        self._bar.update(1)
        return loss

    def log(self, row: dict, show=()) -> dict:
        """Add a metrics row for the current step (``step``, ``lr``, ``tokens_seen`` and ``time_s`` are filled in, and
        after step 0 ``flop_s`` / ``mfu`` over the time since the last row) and show the keys ``show``, the tokens
        per second and the FLOP/s (MFU) since the last row on the bar."""
        lr = {"lr": self.learning_rate()} if self.step > 0 else {}
        now, flops = time.perf_counter(), self.flop_counter.total
        seconds = max(now - self._time_at, 1e-9)
        rate = (self.tokens_seen - self._tokens_at) / seconds
        # data parallel: each process runs the passes this one counted, on its own share of the batch
        flop_s = (flops - self._flops_at) * self.accelerator.num_processes / seconds
        speed = utilisation(flop_s, self.peak_flops) if self.step > 0 and flop_s else {}
        row = self.metrics.add(step=self.step, **row, **lr, tokens_seen=self.tokens_seen,
                               time_s=round(time.time() - self.started, 1), **speed)
        self.curves.send(self.metrics.rows)
        if self._bar is not None and self.step > 0:
            self._tokens_at, self._time_at, self._flops_at = self.tokens_seen, now, flops
            postfix = {k: (f"{row[k]:.3g}" if isinstance(row[k], float) else row[k]) for k in show if k in row}
            self._bar.set_postfix(**postfix, **({"tok_s": f"{rate:.0f}"} if rate else {}),
                                  **({"flop_s": format_utilisation(speed)} if speed else {}))
        return row

    def learning_rate(self) -> float:
        """The learning rate the loop set for this step (``optimizers.set_lr``): that of a parameter group without a
        scale of its own, else the first group's over its scale."""
        groups = self.optimizer.param_groups
        group = next((g for g in groups if g.get("lr_scale", 1.0) == 1.0), groups[0])
        return group["lr"] / group.get("lr_scale", 1.0)

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
        must call it (the RNG states and the FLOP counts are gathered)."""
        rng = gather_rng_states(self.accelerator)
        flops = self.stage_flops(final)
        if self.accelerator.is_main_process:
            files = {"metrics.jsonl": self.metrics.write, **self.files}
            if final:
                name, keys = self.plot
                files[name] = lambda path: self.metrics.plot(path, self.stage, keys)
            counters = {"step": self.step, "tokens_seen": self.tokens_seen, **self.extra, "flops": flops["flops"]}
            meta = {"stage": self.stage, **self.meta, **counters, "mixed_precision": self.accelerator.mixed_precision,
                    "device": device_name(self.accelerator.device), **flops,
                    "metrics": {**self.latest_val(), **self.results},
                    "command": command_line()}

            def write_state(state_dir):
                save_training_state(state_dir, self.optimizer, {**counters, "settings": run_settings(self.args)}, rng)
                if self.write_state is not None:
                    self.write_state(state_dir)

            self.curves.send(self.metrics.rows)  # values added to rows since they were logged
            save_checkpoint(self.args.output_dir, self.unwrapped_model, self.tokenizer, meta,
                            None if final else write_state, files, carry=(CURVES_DIR,))
        self.accelerator.wait_for_everyone()

    def stage_flops(self, final: bool) -> dict:
        """What ``config.json`` records of the stage's arithmetic: ``flops`` ({kind: FLOPs} of every pass of its
        models, all processes summed, the resumed runs' included), ``flop_s`` (their sum over the stage's seconds so
        far), ``peak_flops`` (of all the processes' devices) and, when ``final``, ``matmul_flop_s``
        (``flops.matmul_flop_s`` measured here, in the stage's autocast dtype: the yardstick of the report card's
        matmul share); ``flops.speed_record``. All processes must call it."""
        counted = Counter()
        for flops in gather_object([dict(self.flop_counter.flops)]):
            counted.update(flops)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision, torch.float32)
        self.speed = speed_record(counted, time.time() - self.started, self.accelerator.device,
                                  dtype if final and self.accelerator.is_main_process else None)
        self.speed["peak_flops"] = self.peak_flops  # of all the processes' devices
        return self.speed

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
        if self.exit_code is not None:  # the save that ended the loop has sent every row
            self.curves.close()
            return self.exit_code
        if not self.completed:
            self.save(final=False)
            self.curves.close()
            self.accelerator.print(f"stopped after step {self.step} of {self.args.max_steps}; continue with: "
                                   f"{resume_command()}")
            return 0
        self.save(final=True)
        self.curves.close()
        cli.interrupt_hint = None  # nothing is left to resume
        seconds = time.time() - self.started
        # every pass of the whole stage (evaluations and sampling included) over all its seconds
        flop_s = self.speed["flop_s"]
        speed = format_utilisation(utilisation(flop_s, self.peak_flops)) + ", " if flop_s else ""
        self.accelerator.print(f"saved {self.args.output_dir} (step {self.step}, {self.tokens_seen:,} tokens, "
                               f"{speed}{summary + ', ' if summary else ''}{seconds:.0f} s)")
        return 0
