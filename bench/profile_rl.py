"""Where an RL stage's time goes: sampling, log-probs, scoring, the critic, the updates, the held-out measurement, the
judge, and the Python between them.

    .venv/bin/python bench/profile_rl.py --checkpoints checkpoints --stages ppo dpo grpo grpo-tasks ppo-tasks

Runs each stage's ``main`` in this process, in the pipeline's order and with the pipeline's flags
(``pipeline.STAGE_FLAGS`` and ``PRESET_FLAGS``), from the SFT and RM checkpoints in ``--checkpoints``, writing into
a temporary folder. The functions that do the work are wrapped with a timer that keeps each call's own time
(``exclusive``: a call's time less that of the wrapped calls inside it), by the path of the wrapped calls it ran in
("held-out measurement / sampling" is sampling done by the held-out measurement). Whatever no wrapped function ran
is "other": loading, the optimizer steps of DPO, Python between the steps. As in the pipeline, the SFT policy's
held-out measurement is made once (by the first stage of each path) and reused by the stages after it.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

from pipeline_malloc import run_under_pipeline_malloc  # bench/, this script's folder

import pipeline
from gpt_model import RewardModel
from plumbing import alignment, held_out, rollouts
from plumbing.cli import ArgumentParser, UserError, default_path, run
from plumbing.judge import SentimentJudge
from plumbing.training import StageRun

SCRIPTS = dict(pipeline.STAGES)


class Timer:
    """Wraps functions so that each call adds its own time (less that of the wrapped calls inside it) to
    ``totals[path]``, the path being the labels of the wrapped calls it ran in, outermost first."""

    def __init__(self):
        self.totals, self.stack, self.wrapped = collections.defaultdict(float), [], set()

    def wrap(self, owner, name: str, label: str) -> None:
        if (id(owner), name) in self.wrapped:  # a script's module serves several stages: wrap it once
            return
        self.wrapped.add((id(owner), name))
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            self.stack.append([label, time.perf_counter(), 0.0])  # label, start, time of the calls inside
            try:
                return function(*args, **kwargs)
            finally:
                label_, start, inner = self.stack.pop()
                elapsed = time.perf_counter() - start
                self.totals[" / ".join([f[0] for f in self.stack] + [label_])] += elapsed - inner
                if self.stack:
                    self.stack[-1][2] += elapsed

        setattr(owner, name, timed)


def instrument(timer: Timer, module) -> None:
    """Wrap the work of the aligners, where each is looked up when called."""
    timer.wrap(rollouts, "generate", "sampling")
    timer.wrap(held_out, "generate", "sampling (greedy)")
    timer.wrap(rollouts, "response_logprobs", "log-probs of policy and reference")
    timer.wrap(held_out, "response_logprobs", "log-probs of policy and reference")
    timer.wrap(held_out, "measure", "held-out measurement")
    timer.wrap(alignment.Online, "score", "scoring")
    timer.wrap(alignment.Online, "rollout_row", "rollout monitors")
    timer.wrap(RewardModel, "forward", "reward model or critic forward")
    timer.wrap(SentimentJudge, "__call__", "judge")
    timer.wrap(StageRun, "save", "writing checkpoints")
    for name, label in (("grpo_update", "update"), ("ppo_update", "update"), ("evaluate", "DPO's val pairs")):
        if hasattr(module, name):
            timer.wrap(module, name, label)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=default_path("checkpoints"), help="folder holding sft and rm")
    p.add_argument("--stages", nargs="+", default=["ppo", "dpo", "grpo", "grpo-tasks", "ppo-tasks"],
                   choices=[s for s, _ in pipeline.STAGES[3:]], help="the stages to profile, run in this order")
    p.add_argument("--preset", default="demo", help="the preset each stage runs with, as the pipeline's --preset")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    for name in ("sft", "rm"):
        if not os.path.isfile(os.path.join(args.checkpoints, name, "config.json")):
            raise UserError(f"--checkpoints {args.checkpoints}: no {name} checkpoint there; run make pipeline first, "
                            f"or point --checkpoints at a folder holding sft and rm")
    results, timer = {}, Timer()
    with tempfile.TemporaryDirectory() as out:
        for stage in args.stages:
            module = pipeline.load_stage(SCRIPTS[stage])
            instrument(timer, module)
            timer.totals.clear()
            flags = pipeline.stage_command(stage, SCRIPTS[stage], args.preset)[1:]
            if "--output_dir" in flags:  # the sentiment stage names its own folder: put it in the temporary one
                i = flags.index("--output_dir")
                del flags[i:i + 2]
            argv = [*flags, "--policy", os.path.join(args.checkpoints, "sft"), "--reward",
                    os.path.join(args.checkpoints, "rm"), "--output_dir", os.path.join(out, stage)]
            started = time.perf_counter()
            module.main(argv)
            wall = time.perf_counter() - started
            results[stage] = (wall, dict(timer.totals))
            print(f"{stage}: {wall:.1f} s", flush=True)
    for stage, (wall, totals) in results.items():
        print(f"\n{stage}, {wall:.1f} s\n\n| part | s | share |\n|---|---|---|")
        for path, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"| {path} | {seconds:.1f} | {seconds / wall:.0%} |")
        other = wall - sum(totals.values())
        print(f"| other (loading, Python between the steps, DPO's training steps) | {other:.1f} | {other / wall:.0%} |")
    return 0


if __name__ == "__main__":
    run_under_pipeline_malloc()  # the stages' allocator setting: what is timed is what the pipeline pays
    run(main)
