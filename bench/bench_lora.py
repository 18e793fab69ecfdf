"""Full fine-tuning against LoRA (``--lora_rank``): what trains, how well, how fast, and in how much memory.

    .venv/bin/python bench/bench_lora.py                                   # demo: checkpoints/pretrain, sft, rm
    .venv/bin/python bench/bench_lora.py --preset gpt2-zh-small --sft_steps 20 --grpo_steps 1

Each run is a stage run in a process of its own (so its peak resident memory, ``ru_maxrss``, is its own), on the
stage's real code and data:

* SFT: full fine-tuning, LoRA r = 8 on the query and value projections at the preset's learning rate, and r = 8
  and r = 32 on query and value and on all six linear layers of the blocks at ``--lora_lr_scale`` times it
  (adapters usually want a larger rate): trainable parameters, the val response loss at the end, seconds per step
  (the training steps alone) and the peak memory;
* GRPO: full fine-tuning (its reference is a frozen copy), LoRA r = 8 with the reference as the same network with
  adapters off (``lora.AdaptersOff``, what the stage does), and LoRA r = 8 with a frozen copy as the reference
  instead (patched in for this measurement): the peak memory with and without the separate reference copy.

The demo reads checkpoints/pretrain (SFT's ``--init``), checkpoints/sft and checkpoints/rm (GRPO's ``--policy`` and
``--reward``): run ``make pipeline`` first. For ``gpt2-zh-small`` there is no pretrained checkpoint: randomly
initialised ones are written to a temporary folder, so its losses say nothing of LoRA's quality, only its times
and memory do. Prints one table per stage (the figures of bench/README.md).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def load_stage(filename: str):
    spec = importlib.util.spec_from_file_location(filename.replace("-", "_").removesuffix(".py"),
                                                  os.path.join(ROOT, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def frozen_copy_reference(policy):
    """What the reference would be without ``AdaptersOff``: a separate frozen copy of the policy's base (its
    adapters are zero at step 0, so merging them leaves the base weights)."""
    from lora import merge_lora

    return merge_lora(copy.deepcopy(policy)).requires_grad_(False).eval()


def child(script: str, argv: list[str], reference: str) -> None:
    """Run one stage in this process and print its seconds and peak resident memory as one JSON line."""
    if reference == "copy":
        import plumbing.alignment

        plumbing.alignment.AdaptersOff = frozen_copy_reference
    stage = load_stage(script)
    start = time.perf_counter()
    code = stage.main(argv)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print("RESULT " + json.dumps({"code": code, "seconds": seconds, "peak_mb": peak_mb}))


def run_child(script: str, argv: list[str], reference: str = "stage") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", script, "--reference", reference, "--", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"{script} {' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def seconds_per_step(output_dir: str) -> float:
    """Seconds per training step from metrics.jsonl's ``time_s``, between the first and the last training row
    (the evaluations at step 0 and at the end lie outside)."""
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [r for r in map(json.loads, f) if "train_loss" in r or "loss" in r or "score" in r]
    first, last = rows[0], rows[-1]
    return (last["time_s"] - first["time_s"]) / max(last["step"] - first["step"], 1)


def random_checkpoints(preset: str, folder: str) -> tuple[str, str, str]:
    """Randomly initialised pretrain / SFT / RM checkpoints of ``preset`` (for sizes with no trained ones)."""
    import torch

    from chinese_tokenizer import load_tokenizer
    from gpt_model import GPTModel, RewardModel, get_preset
    from plumbing.checkpoint import save_checkpoint

    tokenizer = load_tokenizer(os.path.join(ROOT, "data", "tokenizer"))
    torch.manual_seed(0)
    model = GPTModel(get_preset(preset))
    paths = {name: os.path.join(folder, name) for name in ("pretrain", "sft", "rm")}
    save_checkpoint(paths["pretrain"], model, tokenizer, {"stage": "pretrain"})
    save_checkpoint(paths["sft"], model, tokenizer, {"stage": "sft"})
    rm = RewardModel(model.cfg)
    rm.backbone.load_state_dict(model.state_dict())
    save_checkpoint(paths["rm"], rm, tokenizer, {"stage": "rm"})
    return paths["pretrain"], paths["sft"], paths["rm"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo", choices=["demo", "gpt2-zh-small"])
    p.add_argument("--sft_steps", type=int, help="SFT steps per run (default: the preset's, 300 for the demo)")
    p.add_argument("--grpo_steps", type=int, default=2, help="GRPO iterations per run")
    p.add_argument("--lora_lr_scale", type=float, default=5.0, help="LoRA's second learning rate, x the preset's")
    p.add_argument("--skip_sft_runs", type=int, default=0, help="start at this SFT run (to add rows to a table)")
    p.add_argument("--skip_grpo", action="store_true", help="measure SFT alone")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--reference", default="stage", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.child:
        child(args.child, [a for a in rest if a != "--"], args.reference)
        return 0

    subprocess.run(["lscpu"], check=False)
    work = tempfile.mkdtemp(prefix="bench_lora-")
    if args.preset == "demo":
        init, policy, reward = (os.path.join(ROOT, "checkpoints", n) for n in ("pretrain", "sft", "rm"))
    else:
        init, policy, reward = random_checkpoints(args.preset, work)
    sft_lr = load_stage("1-SFT.py").DEFAULTS[args.preset]["learning_rate"]
    steps = args.sft_steps or load_stage("1-SFT.py").DEFAULTS[args.preset]["max_steps"]

    print(f"\nSFT, preset {args.preset}, {steps} steps (val response loss at the end)\n")
    print("| run | learning rate | trained parameters | val loss | s/step | peak memory (MB) |")
    print("|---|---|---|---|---|---|")
    scale = args.lora_lr_scale
    runs = [("full", [], sft_lr), ("LoRA r=8, q+v", ["--lora_rank", "8"], sft_lr)]
    for rank in (8, 32):
        runs += [(f"LoRA r={rank}, q+v", ["--lora_rank", str(rank)], sft_lr * scale),
                 (f"LoRA r={rank}, all", ["--lora_rank", str(rank), "--lora_targets", "all"], sft_lr * scale)]
    for name, extra, lr in runs[args.skip_sft_runs:]:
        out = os.path.join(work, f"sft-{len(os.listdir(work))}")
        argv = ["--preset", args.preset, "--init", init, "--output_dir", out, "--max_steps", str(steps),
                "--eval_every", str(steps), "--learning_rate", str(lr), *extra]
        if args.preset != "demo":  # a random model's loss means little: a small evaluation is enough
            argv += ["--eval_examples", "32", "--num_samples", "1"]
        result = run_child("1-SFT.py", argv)
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        trained = trainable_count(args.preset, extra)
        print(f"| {name} | {lr:g} | {trained:,} | {config['metrics']['val_loss']:.3f} | "
              f"{seconds_per_step(out):.3f} | {result['peak_mb']:.0f} |", flush=True)

    if args.skip_grpo:
        return 0
    print(f"\nGRPO, preset {args.preset}, {args.grpo_steps} iterations (peak resident memory of the process)\n")
    print("| run | reference | peak memory (MB) | s/iteration |")
    print("|---|---|---|---|")
    for name, extra, reference in (("full", [], "stage"), ("LoRA r=8, q+v", ["--lora_rank", "8"], "stage"),
                                   ("LoRA r=8, q+v", ["--lora_rank", "8"], "copy")):
        out = os.path.join(work, f"grpo-{len(os.listdir(work))}")
        argv = ["--preset", args.preset, "--policy", policy, "--reward", reward, "--output_dir", out,
                "--max_steps", str(args.grpo_steps), "--eval_examples", "8", "--eval_samples", "1",
                "--max_new_tokens", "32", *extra]
        result = run_child("3-GRPO.py", argv, reference)
        ref = ("a frozen copy" if not extra or reference == "copy" else "the policy with adapters off")
        print(f"| {name} | {ref} | {result['peak_mb']:.0f} | {seconds_per_step(out):.2f} |", flush=True)
    return 0


def trainable_count(preset: str, extra: list[str]) -> int:
    from gpt_model import GPTModel, get_preset
    from lora import add_lora, trainable_parameters

    model = GPTModel(get_preset(preset))
    if extra:
        add_lora(model, int(extra[1]), 2.0 * int(extra[1]), extra[3] if len(extra) > 2 else "W_query,W_value")
    return trainable_parameters(model)


if __name__ == "__main__":
    sys.exit(main())
