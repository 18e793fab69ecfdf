"""A small sweep of alignment recipes (PPO, DPO or GRPO): each runs the stage script to the end and is judged on
the held-out prompts.

Every recipe is the demo preset plus a few flags. For each the table shows what an aligned policy must do on the
held-out prompts: the KL to SFT (budget 3 nats per response), the RM score gain (>= +1), the independent judge
(higher than SFT's, beyond its standard error), distinct-2 (no lower than SFT's minus 0.05), the share of answers
that end with [SEP] (no lower than SFT's), the length, the longest repeated run, the flag, and the wall time.

    python bench/sweep_align.py --stage ppo                                    # every PPO recipe
    python bench/sweep_align.py --stage ppo --only beta2-h64,old --seeds 1234,1  # two recipes, two seeds
    python bench/sweep_align.py --stage dpo --only beta0.5                     # one DPO recipe
    python bench/sweep_align.py --stage grpo --table_only                      # re-read finished runs

Runs go to ``--out/<stage>/<recipe>-s<seed>`` (kept, so ``--table_only`` can redraw the table; a finished run is
not run again). The recipes run one after another: on a shared 2-core machine two at once only slow each other.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing.cli import ArgumentParser

# Every flag a PPO recipe changes is spelled out, so that a recipe keeps its meaning when 3-PPO.py's defaults
# change; the rest is the demo preset (20 iterations, learning rate 1e-4, 4 PPO epochs).
NEW = dict(rollout_size=16, batch_size=8, kl_coef=0.2, target_kl=3, kl_horizon=64, no_eos_penalty=1,
           max_approx_kl=0.02)


def flags(**values) -> str:
    return " ".join(f"--{k} {v}" for k, v in values.items())


PPO_RECIPES = {
    "old": flags(rollout_size=16, batch_size=8, kl_coef=0.05, target_kl=6, kl_horizon=10000, no_eos_penalty=0,
                 max_approx_kl=0),  # the demo before issue 19
    "beta0.05-h64": flags(**{**NEW, "kl_coef": 0.05}),
    "beta0.2-h64": flags(**NEW),
    "beta0.2-h16": flags(**{**NEW, "kl_horizon": 16}),
    "beta0.2-h64-40it": flags(**NEW, max_steps=40),
    "beta0.2-h64-no-eos-penalty": flags(**{**NEW, "no_eos_penalty": 0}),
    "beta0.2-h64-32rollouts": flags(**{**NEW, "rollout_size": 32, "batch_size": 16}),
    "beta1-h64": flags(**{**NEW, "kl_coef": 1.0}),
    "beta0.2-h64-lr3e-5": flags(**NEW, learning_rate=3e-5),
    "beta0.5-h64-lr5e-5": flags(**{**NEW, "kl_coef": 0.5}, learning_rate=5e-5),
    "beta2-h64": flags(**{**NEW, "kl_coef": 2.0}),
    "beta1-h64-lr5e-5": flags(**{**NEW, "kl_coef": 1.0}, learning_rate=5e-5),
    "beta2-h64-lr5e-5": flags(**{**NEW, "kl_coef": 2.0}, learning_rate=5e-5),
    "beta4-h64": flags(**{**NEW, "kl_coef": 4.0}),
}
# DPO (demo: 150 steps of 8 pairs, learning rate 1e-4): how far beta, the run's length and the rate let it move
DPO_RECIPES = {
    "beta0.1": flags(beta=0.1),
    "beta0.5": flags(beta=0.5),
    "beta1": flags(beta=1.0),
    "beta0.1-60steps": flags(beta=0.1, max_steps=60),
    "beta0.5-60steps": flags(beta=0.5, max_steps=60),
    "beta1-60steps": flags(beta=1.0, max_steps=60),
    "beta0.5-60steps-lr3e-5": flags(beta=0.5, max_steps=60, learning_rate=3e-5),
    "ipo-beta0.5-60steps": flags(loss="ipo", beta=0.5, max_steps=60),
}
# GRPO (4 prompts x 8 samples an iteration): the KL weight, the rate and the length, each spelled out
GRPO_RECIPES = {
    "kl0.04": flags(kl_coef=0.04, learning_rate=5e-5, max_steps=20),
    "kl0.1": flags(kl_coef=0.1, learning_rate=5e-5, max_steps=20),
    "kl0.2": flags(kl_coef=0.2, learning_rate=5e-5, max_steps=20),
    "kl0.04-lr3e-5": flags(kl_coef=0.04, learning_rate=3e-5, max_steps=20),
    "kl0.1-lr3e-5": flags(kl_coef=0.1, learning_rate=3e-5, max_steps=20),
    "kl0.04-15it": flags(kl_coef=0.04, learning_rate=5e-5, max_steps=15),
    "kl0.04-lr3e-5-30it": flags(kl_coef=0.04, learning_rate=3e-5, max_steps=30),
    "kl0.1-lr4e-5": flags(kl_coef=0.1, learning_rate=4e-5, max_steps=20),
    "kl0.2-lr3e-5": flags(kl_coef=0.2, learning_rate=3e-5, max_steps=20),
    "kl0.1-lr2e-5": flags(kl_coef=0.1, learning_rate=2e-5, max_steps=20),
    "kl0.2-lr2e-5": flags(kl_coef=0.2, learning_rate=2e-5, max_steps=20),
    "kl0.4-lr3e-5": flags(kl_coef=0.4, learning_rate=3e-5, max_steps=20),
}
RECIPES = {"ppo": PPO_RECIPES, "dpo": DPO_RECIPES, "grpo": GRPO_RECIPES}
SCRIPTS = {"ppo": "3-PPO.py", "dpo": "3-DPO.py", "grpo": "3-GRPO.py"}
# added to every run: the held-out monitors and DPO's val pairs only before and after the run, as in the demo (a
# measurement in between runs under its own fixed seed and would change nothing else)
SWEEP_FLAGS = "--eval_every 1000"


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="ppo", choices=sorted(RECIPES), help="which alignment stage to sweep")
    p.add_argument("--policy", default=os.path.join(ROOT, "checkpoints", "sft"), help="SFT checkpoint")
    p.add_argument("--reward", default=os.path.join(ROOT, "checkpoints", "rm"), help="reward model checkpoint")
    p.add_argument("--out", default=os.path.join(ROOT, "checkpoints", "sweep_align"), help="where the runs go")
    p.add_argument("--only", help="comma-separated recipe names (default: all of the stage's): " + "; ".join(
        f"{stage}: {', '.join(recipes)}" for stage, recipes in RECIPES.items()))
    p.add_argument("--seeds", default="1234", help="comma-separated integer seeds; each recipe runs once per seed")
    p.add_argument("--extra", default="", help="flags added to every run, e.g. \"--max_steps 10\"")
    p.add_argument("--table_only", action="store_true", help="run nothing, print the table of finished runs")
    return p.parse_args(argv)


def run_one(name, seed, args) -> float | None:
    """Run one recipe with one seed unless it already finished (an interrupted run is resumed); returns its wall
    time (None if it was done)."""
    out = os.path.join(args.out, args.stage, f"{name}-s{seed}")
    interrupted = os.path.isdir(os.path.join(out, "state"))
    if os.path.isfile(os.path.join(out, "config.json")) and not interrupted:
        return None
    command = [sys.executable, os.path.join(ROOT, SCRIPTS[args.stage]), "--policy", args.policy, "--reward",
               args.reward, "--output_dir", out, "--resume" if interrupted else "--overwrite", "--seed", str(seed),
               *shlex.split(RECIPES[args.stage][name]),
               *shlex.split(SWEEP_FLAGS), *shlex.split(args.extra)]
    print("$ " + " ".join(shlex.quote(c) for c in command), flush=True)
    t0 = time.time()
    result = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    lines = [line for line in result.stdout.splitlines() if "it/s" not in line and "s/it" not in line]
    print("\n".join(lines[-4:]), flush=True)
    if result.returncode != 0:
        print(f"  {name} seed {seed} failed (exit code {result.returncode})", flush=True)
        return wall
    with open(os.path.join(out, "wall_time.json"), "w", encoding="utf-8") as f:
        json.dump({"wall_s": wall, **({"note": "resumed: the time after the interruption only"} if interrupted
                                       else {})}, f)
    return wall


def row_of(name, seed, args):
    out = os.path.join(args.out, args.stage, f"{name}-s{seed}")
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            metrics = json.load(f)["metrics"]
    except (OSError, KeyError, ValueError):
        return None
    if "held_out" not in metrics:
        return None
    sft, ppo = metrics["held_out"]["sft"], metrics["held_out"][args.stage]
    wall, note = None, None
    if os.path.isfile(os.path.join(out, "wall_time.json")):
        with open(os.path.join(out, "wall_time.json"), encoding="utf-8") as f:
            timing = json.load(f)
        wall, note = timing["wall_s"], timing.get("note")
    passed = [ppo["kl"] <= 3.0, ppo["rm_score"] - sft["rm_score"] >= 1.0,
              ppo["judge"] - sft["judge"] > 2 * (sft["judge_se"] ** 2 + ppo["judge_se"] ** 2) ** 0.5,
              ppo["distinct_2"] >= sft["distinct_2"] - 0.05, ppo["eos_share"] >= sft["eos_share"]]
    return [f"{name} (seed {seed})", f"{ppo['kl']:.2f}", f"{ppo['rm_score'] - sft['rm_score']:+.2f}",
            f"{sft['judge']:.3f} → {ppo['judge']:.3f} ± {ppo['judge_se']:.3f}",
            f"{sft['distinct_2']:.3f} → {ppo['distinct_2']:.3f}", f"{sft['eos_share']:.0%} → {ppo['eos_share']:.0%}",
            f"{sft['length']:.1f} → {ppo['length']:.1f}", f"{sft['longest_run']:.1f} → {ppo['longest_run']:.1f}",
            f"{sum(passed)}/5", "yes" if metrics.get("reward_hacking") else "no",
            "—" if wall is None else f"{wall:.0f} s{' *' if note else ''}"]


def main(argv=None):
    args = parse_args(argv)
    recipes = RECIPES[args.stage]
    names = args.only.split(",") if args.only else list(recipes)
    unknown = [n for n in names if n not in recipes]
    if unknown:
        print(f"error: --only: unknown {args.stage} recipe(s) {', '.join(unknown)}; choose from "
              f"{', '.join(recipes)}", file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"error: --seeds {args.seeds!r} must be comma-separated integers, e.g. 1234,1", file=sys.stderr)
        return 2
    if not args.table_only:
        os.makedirs(args.out, exist_ok=True)
        for name in names:
            for seed in seeds:
                run_one(name, seed, args)
    headers = ["recipe", "KL", "RM gain", f"judge SFT → {args.stage.upper()} ± SE", "distinct-2", "ends with [SEP]",
               "length",
               "longest run", "5 checks", "flag", "wall"]
    rows = [row for name in names for seed in seeds if (row := row_of(name, seed, args))]
    if not rows:
        print(f"no finished {args.stage} runs in {os.path.join(args.out, args.stage)}", file=sys.stderr)
    print("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
