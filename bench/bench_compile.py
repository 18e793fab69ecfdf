"""``--compile`` measured: each demo stage run whole, with and without ``torch.compile``, on this machine.

    python bench/bench_compile.py                      # pretraining and SFT at the demo preset (~17 min on 2 cores)
    python bench/bench_compile.py --stages pretrain --max_steps 120

For each stage and setting it reports the stage's wall time (start-up, compilation, training and evaluations: what
a user waits for), the first step's time (where compilation happens), the median time of the other steps (from the
FLOP/s the stage logs for each step, ``plumbing/flops.py``) and the tokens/s over the whole run. Both runs of a
stage start from the same weights and data, so only the compilation differs. The table goes in bench/README.md
("`--compile`").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench_attention import cpu_name  # noqa: E402 (the repository on the path first)

SCRIPTS = {"pretrain": "0-PRETRAIN.py", "sft": "1-SFT.py"}


def run_stage(stage: str, out: str, compiled: bool, extra: list[str]) -> dict:
    """One run of the stage into ``out``; its wall time and what its metrics.jsonl and config.json say."""
    command = [sys.executable, SCRIPTS[stage], "--output_dir", out, "--overwrite", *extra]
    if compiled:
        command.append("--compile")
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    per_token = config["flops"]["train"] / config["tokens_seen"]  # the training FLOPs of one token
    steps = [r for r in rows if r.get("step", 0) > 0 and "flop_s" in r and "val_loss" not in r]
    seconds, previous = [], 0
    for r in steps:  # a step's seconds = its tokens x FLOPs per token / the FLOP/s logged for it (no eval in it)
        seconds.append((r["tokens_seen"] - previous) * per_token / r["flop_s"])
        previous = r["tokens_seen"]
    return {"wall_s": wall, "first_step_s": seconds[0], "step_s": statistics.median(seconds[1:]),
            "tokens_per_s": rows[-1]["tokens_seen"] / rows[-1]["time_s"],
            "val_loss": config["metrics"].get("val_loss"), "steps": config["step"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stages", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS),
                   help="the stages to run twice (sft starts from this bench's pretraining, else checkpoints/pretrain)")
    p.add_argument("--max_steps", type=int, help="shorter runs than the preset's (default: the whole stage)")
    args = p.parse_args()
    import torch

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    steps = ["--max_steps", str(args.max_steps)] if args.max_steps else []
    work = tempfile.mkdtemp(prefix="bench_compile_")  # the runs' checkpoints, removed at the end
    print("| stage | torch.compile | wall time (s) | first step (s) | other steps, median (s) | tokens/s | val loss |")
    print("|---|---|---|---|---|---|---|")
    try:
        for stage in args.stages:
            extra = list(steps)
            if stage == "sft":  # from the eager pretraining run of this bench, or the pipeline's checkpoint
                parent = os.path.join(work, "pretrain-eager")
                extra += ["--init", parent if os.path.isdir(parent) else os.path.join(ROOT, "checkpoints", "pretrain")]
            for compiled in (False, True):
                out = os.path.join(work, f"{stage}-{'compiled' if compiled else 'eager'}")
                r = run_stage(stage, out, compiled, extra)
                print(f"| {stage} ({r['steps']} steps) | {'on' if compiled else 'off'} | {r['wall_s']:.0f} | "
                      f"{r['first_step_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['val_loss']:.3f} |",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
