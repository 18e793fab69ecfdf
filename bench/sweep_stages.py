"""Recipe sweep for the demo SFT and reward model: each recipe is the stage script itself with a few flags changed.

    .venv/bin/python bench/sweep_stages.py --list                  # the recipes and their flags
    .venv/bin/python bench/sweep_stages.py sft sft-lr1e-3          # run two SFT recipes, one after the other
    .venv/bin/python bench/sweep_stages.py --group rm              # every RM recipe
    .venv/bin/python bench/sweep_stages.py --table                 # the results so far as a markdown table

A run is ``python 1-SFT.py --preset demo --init <parents>/pretrain <flags>`` (or ``2-RM.py --init <parents>/sft``)
writing to a scratch directory; ``--parents`` defaults to ``checkpoints/`` (build it with ``make pipeline`` or the stage
scripts first). A later ``--init`` among the flags wins. The figure is what the report card shows: SFT's val response
loss on its 200 fixed val pairs, the RM's test pair accuracy, each with the stage's wall time. Runs are deterministic
given the recipe and the parent; the seconds depend on the machine and its load. Results are appended as JSON lines to
--results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from plumbing.cli import ArgumentParser, run

# name -> (stage, flags added to the stage's demo defaults). The first recipe of each stage is today's default.
RECIPES = {
    "sft": ("sft", []),
    "sft-lr1e-3": ("sft", ["--learning_rate", "1e-3"]),
    "sft-lr4e-3": ("sft", ["--learning_rate", "4e-3"]),
    "sft-600": ("sft", ["--max_steps", "600"]),
    "sft-b8": ("sft", ["--batch_size", "8", "--max_steps", "600"]),
    "rm": ("rm", []),
    "rm-emb1-450": ("rm", ["--embedding_lr_scale", "1", "--max_steps", "450", "--eval_every", "150"]),
    "rm-450": ("rm", ["--max_steps", "450", "--eval_every", "150"]),
    "rm-emb100": ("rm", ["--embedding_lr_scale", "100"]),
    "rm-lr1e-3": ("rm", ["--learning_rate", "1e-3"]),
    "rm-lr2e-4": ("rm", ["--learning_rate", "2e-4"]),
    "rm-900": ("rm", ["--max_steps", "900"]),
    "rm-300": ("rm", ["--max_steps", "300"]),
    "rm-head30": ("rm", ["--head_lr_scale", "30"]),
    "rm-from-pretrain": ("rm", ["--init", "{parents}/pretrain"]),
    "rm-b32-lr1e-3": ("rm", ["--batch_size", "32", "--max_steps", "225", "--learning_rate", "1e-3"]),
}
SCRIPTS = {"sft": "1-SFT.py", "rm": "2-RM.py"}
FIGURES = {"sft": ("val_loss", "val response loss"), "rm": ("test_accuracy", "test accuracy")}


def run_recipe(name: str, python: str, parents: str) -> dict:
    """Train one recipe into a scratch directory; returns its row (figure, seconds, the stage's final metrics)."""
    stage, flags = RECIPES[name]
    flags = [f.format(parents=parents) for f in flags]
    out = tempfile.mkdtemp(prefix=f"sweep-{name}-")
    parent = os.path.join(parents, "pretrain" if stage == "sft" else "sft")
    command = [python, os.path.join(ROOT, SCRIPTS[stage]), "--preset", "demo", "--init", parent,
               "--output_dir", out, "--overwrite", *flags]
    print(f"$ {' '.join(command)}", flush=True)
    started = time.time()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.time() - started
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"{name} failed (exit code {result.returncode})")
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        metrics = json.load(f)["metrics"]
    shutil.rmtree(out)
    key, label = FIGURES[stage]
    print(f"  {name}: {label} {metrics[key]:.4f} in {seconds:.0f} s", flush=True)
    return {"name": name, "stage": stage, "flags": flags, "figure": metrics[key], "seconds": round(seconds, 1),
            "load_average": round(os.getloadavg()[0], 2), "metrics": {k: v for k, v in metrics.items()
                                                                     if isinstance(v, (int, float))}}


def print_table(path: str) -> None:
    """The last row of each recipe in --results, as a markdown table per stage."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for row in map(json.loads, f):
            rows[row["name"]] = row
    for stage, (_, label) in FIGURES.items():
        print(f"\n| {stage} recipe | flags | {label} | seconds |\n|---|---|---|---|")
        for row in rows.values():
            if row["stage"] == stage:
                print(f"| {row['name']} | `{' '.join(row['flags']) or '(demo defaults)'}` | {row['figure']:.4f} | "
                      f"{row['seconds']:.0f} |")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("names", nargs="*", help="recipes to run, in order (see --list)")
    p.add_argument("--group", choices=sorted(SCRIPTS), help="run every recipe of this stage")
    p.add_argument("--list", action="store_true", help="print the recipes and exit")
    p.add_argument("--table", action="store_true", help="print the rows of --results as markdown tables and exit")
    p.add_argument("--parents", default=os.path.join(ROOT, "checkpoints"),
                   help="directory holding the parent checkpoints pretrain/ (for SFT) and sft/ (for the RM)")
    p.add_argument("--results", default=os.path.join(tempfile.gettempdir(), "sweep_stages.jsonl"),
                   help="JSON lines file the rows are appended to")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for name, (stage, flags) in RECIPES.items():
            print(f"{stage:<4} {name:<18} {' '.join(flags) or '(demo defaults)'}")
        return 0
    if args.table:
        print_table(args.results)
        return 0
    names = list(args.names) + [n for n, (stage, _) in RECIPES.items() if stage == args.group]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        print(f"error: give recipe names or --group (unknown: {unknown}); see --list", file=sys.stderr)
        return 2
    for name in names:
        row = run_recipe(name, sys.executable, os.path.abspath(args.parents))
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    run(main)
