"""Command-line plumbing shared by every script: user errors, the arguments all stages take, argument checks.

A ``UserError`` is a problem with the user's input (a file, an argument, a checkpoint). ``run`` prints it as one
line, ``error: <what is wrong> (<where>); <what to do>``, and exits with code 2, so no traceback reaches the user for
a mistake they can fix.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading

from chinese_tokenizer import TokenizerError
from gpt_model import PRESETS
from lora import DEFAULT_TARGETS, parse_targets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UserError(Exception):
    """Bad input from the user; the message says what is wrong, where, and what to do."""


USER_ERRORS = (UserError, TokenizerError)  # what ``run`` prints as one line: the tokenizer's errors are the user's too


# what ``run`` adds to its "stopped by SIGINT" line, set by a stage once something is saved that --resume continues
interrupt_hint = None


def run(main, argv=None) -> None:
    """Call ``main(argv)``; turn a ``UserError`` into one line on stderr and exit code 2, and Ctrl-C or SIGTERM
    outside a training loop (which saves a resumable state instead, ``training.StopSignal``) into one line and
    128 + the signal's number, after the ``finally`` blocks on the way have cleaned up (e.g. a half-written
    token file). The line ends with ``interrupt_hint`` when a stage has set one."""
    global interrupt_hint
    interrupt_hint = None  # a hint belongs to this run only

    def stop(signum, frame):
        raise KeyboardInterrupt(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    old = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        code = main(argv)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        hint = f"; {interrupt_hint}" if interrupt_hint else ""
        print(f"stopped by {signal.Signals(signum).name}{hint}", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
    sys.exit(code or 0)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows an argument's default in --help only when there is one worth showing (not None, not a False flag);
    the description and epilog keep their line breaks."""

    def _get_help_string(self, action):
        if action.default in (None, False, [], "") or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (no usage block) with exit code 2, like ``run``.
    Flags must be spelled out: argparse's default of accepting any unambiguous prefix (``--max_step``) would let
    a typo or a future flag change what an old command means."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:  # inf would pass a plain >= 0 (e.g. --temperature inf: uniform noise)
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


# A preset whose model is the size of another's trains with that preset's values in a stage that gives it none of its
# own: uer/gpt2-chinese-cluecorpussmall's weights are gpt2-zh-small's shape (12 x 768).
SAME_SIZE = {"uer-gpt2-chinese": "gpt2-zh-small"}


# where a training stage's curves can go (--report_to): Accelerate's trackers, or none
REPORT_TO = ("tensorboard", "wandb", "trackio", "none")


def stage_parser(description: str, output_dir: str, defaults: dict, steps: str = "optimizer steps",
                 examples: str = "validation pairs", new_model: bool = False) -> ArgumentParser:
    """An ``ArgumentParser`` with the flags every training stage shares; ``--help`` ends with the stage's
    per-preset ``defaults`` (the values used for flags left unset). ``steps`` names what ``--max_steps`` counts
    in this stage (PPO and GRPO count iterations: a rollout and the updates on it), ``examples`` what
    ``--eval_examples`` counts (validation pairs, blocks of text, held-out prompts); ``new_model`` says that the
    stage can build a model of the preset's size (pretraining), so ``--preset``'s help lists the sizes.

    The stage adds its own data and model-source flags (``--init``, ``--policy``/``--reward``) after this.
    """
    sizes = "; ".join(f"{name}: {c.n_layers} layers x {c.emb_dim}, {c.context_length} positions"
                      for name, c in PRESETS.items())
    epilog = "defaults per --preset (any flag overrides):\n" + "\n".join(
        [f"  {name}: " + ", ".join(f"--{k} {v}" for k, v in values.items()) for name, values in defaults.items()]
        + [f"  {name}: as {like}" for name, like in SAME_SIZE.items() if name not in defaults])
    p = ArgumentParser(description=description, epilog=epilog)
    size = (f"; a new model also takes the preset's size ({sizes}), a model loaded from a checkpoint keeps its own"
            if new_model else "; the model keeps the size of the checkpoint it starts from")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS),
                   help=f"run length and optimisation (see the end of this help){size}")
    p.add_argument("--output_dir", default=output_dir, help="where the stage checkpoint is written")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint in --output_dir")
    p.add_argument("--resume", action="store_true",
                   help="continue from --output_dir/state (saved by Ctrl-C, --stop_after or --save_every)")
    p.add_argument("--seed", type=int, default=1234, help="one seed for weights, data order, dropout, sampling")
    p.add_argument("--max_steps", type=positive_int,
                   help=f"length of the whole run in {steps} (default: the preset's)")
    p.add_argument("--stop_after", type=positive_int,
                   help="run only this many steps now, save a resumable state and exit (continue with --resume)")
    p.add_argument("--batch_size", type=positive_int, help="sequences per process per micro-batch")
    p.add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                   help="micro-batches per optimizer step")
    p.add_argument("--learning_rate", type=positive_float, help="peak learning rate")
    p.add_argument("--weight_decay", type=non_negative_float, default=0.1, help="AdamW decoupled weight decay")
    p.add_argument("--warmup_steps", type=non_negative_int, help="linear warm-up steps before the cosine decay")
    p.add_argument("--max_grad_norm", type=positive_float, default=1.0, help="gradient clipping threshold")
    p.add_argument("--eval_every", type=positive_int, help="evaluate every N steps")
    p.add_argument("--eval_examples", type=positive_int, help=f"{examples} used at each evaluation")
    p.add_argument("--save_every", type=positive_int, help="save a resumable checkpoint every N steps")
    p.add_argument("--mixed_precision", default="auto", choices=["auto", "no", "bf16", "fp16"],
                   help="autocast precision of the matmuls: auto keeps what `accelerate launch` was given "
                        "(--mixed_precision or its config); under plain python it is bf16 where the hardware "
                        "computes bf16 natively (a GPU with bf16, a CPU with AVX512-BF16 or AMX), else no (fp32)")
    p.add_argument("--compile", action="store_true",
                   help="compile the model with torch.compile (Inductor), as `accelerate launch --dynamo_backend "
                        "inductor` does: fused kernels for the norms, GELU and residuals at the cost of a compile "
                        "at the start (and again when batch shapes change); measured in bench/README.md")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic GPU kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG="
                        ":4096:8, attention through the math kernel), so that a --resume on a GPU repeats the run "
                        "bit for bit; slower. Without a GPU it changes nothing: a CPU run repeats itself anyway")
    p.add_argument("--report_to", default="tensorboard", choices=REPORT_TO,
                   help="where the metrics.jsonl values are logged as curves too, through Accelerate's trackers: "
                        "TensorBoard event files in --output_dir/tensorboard (watch a whole pipeline with "
                        "`tensorboard --logdir checkpoints`), a wandb or trackio run (their package installed), or "
                        "none")
    p.add_argument("--tokenizer", default=default_path("data", "tokenizer"), help="tokenizer directory")
    return p


def add_optimizer_argument(p) -> None:
    """``--optimizer`` of the stages that train a whole language model (pretraining, SFT); default: the preset's."""
    p.add_argument("--optimizer", choices=["adamw", "muon"],
                   help="adamw for every weight, or muon: Muon for the blocks' matrices at 10x --learning_rate and "
                        "AdamW for the token embedding at 30x and the norms and biases at 1x "
                        "(optimizers.make_optimizer; default: the preset's)")


def add_lora_arguments(p) -> None:
    """``--lora_rank``, ``--lora_alpha`` and ``--lora_targets`` of the stages that tune a language model (1-SFT.py,
    3-DPO.py, 3-GRPO.py, 3-PPO.py): with a rank, the stage trains LoRA adapters alone (``lora.add_lora``) and
    writes an adapter checkpoint over its parent; ``check_lora_arguments`` fills ``--lora_alpha``."""
    p.add_argument("--lora_rank", type=positive_int,
                   help="train LoRA adapters of this rank instead of every weight (Hu et al. 2021; e.g. 8): the "
                        "checkpoint then holds the adapters alone and names its base by path and sha256")
    p.add_argument("--lora_alpha", type=float,
                   help="the adapters' scale alpha; the update is (alpha / rank) B A (default: 2 x --lora_rank)")
    p.add_argument("--lora_targets",
                   help="which linear layers of each block get adapters, comma-separated from W_query, W_key, "
                        "W_value, out_proj, ff.layers.0, ff.layers.2, or 'all' (default: W_query,W_value, the "
                        "paper's)")


def check_lora_arguments(args) -> None:
    """Check the LoRA flags (``add_lora_arguments``) and fill ``--lora_alpha`` and ``--lora_targets``.

    Raises:
        UserError: a bad value; ``--lora_alpha`` or ``--lora_targets`` without ``--lora_rank`` (they would be
            ignored); ``--optimizer muon`` with a rank (Muon orthogonalises whole matrices, not adapters).
    """
    if args.lora_rank is None:
        for flag in ("lora_alpha", "lora_targets"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag} goes with --lora_rank; give a rank (e.g. --lora_rank 8) or drop it")
        return
    if getattr(args, "optimizer", None) == "muon":
        raise UserError("--optimizer muon updates whole weight matrices; with --lora_rank use --optimizer adamw")
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    if not args.lora_alpha > 0:
        raise UserError(f"--lora_alpha {args.lora_alpha} must be > 0")
    try:
        args.lora_targets = DEFAULT_TARGETS if args.lora_targets is None else parse_targets(args.lora_targets)
    except ValueError as e:
        raise UserError(f"--lora_targets: {e}") from e


def default_path(*parts: str) -> str:
    """A path relative to the repository (the folder above this package), shown relative to the working
    directory."""
    path = os.path.join(REPO_ROOT, *parts)
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path


def fill_defaults(args: argparse.Namespace, defaults: dict) -> argparse.Namespace:
    """Set every argument the user left as ``None`` from the stage's preset defaults."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args
