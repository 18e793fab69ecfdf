"""Recipe sweep for the demo pretraining: short runs that print validation loss against tokens and seconds.

    .venv/bin/python bench/sweep_pretrain.py --list                    # the recipes and what each changes
    .venv/bin/python bench/sweep_pretrain.py old demo                  # run two of them, one after the other
    .venv/bin/python bench/sweep_pretrain.py --group lr                # one group of the sweep (see --list)
    .venv/bin/python bench/sweep_pretrain.py demo --time_only          # tokens/s from 12 timed steps, no eval

Each recipe is the demo before this sweep (``old``: AdamW 2e-3, learned positions, 240 steps of 8 blocks of 256
tokens, fp32) with a few values changed; ``demo`` is what 0-PRETRAIN's demo defaults and PRESETS["demo"] are now
(the winner, ``m5-2x``).
A run trains exactly as 0-PRETRAIN does (same packed blocks, same ``BatchSchedule`` data order and seed, gradient
clipping at 1.0, ``training.set_lr``), but in one process with no checkpoints, and evaluates the validation loss on
a fixed evenly spread subset of the val blocks (``--eval_tokens`` predictions, at the run's block length) at four
points of the run, then on every val block at the end. Seconds count training steps only (evaluation excluded).

Runs are deterministic given the recipe (the loss column can be compared across machines and loads); seconds and
tokens/s depend on the machine and on whatever else runs on it, so time each recipe alone (``--time_only``) on an
idle machine. Results are appended as JSON lines to --results. On glibc the script restarts itself once with the
malloc setting that ``make pipeline`` uses (see bench/README.md), so the seconds match the pipeline's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

from pipeline_malloc import run_under_pipeline_malloc

if __name__ == "__main__":
    run_under_pipeline_malloc()

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpt_model import GPTModel, get_preset
from plumbing.batching import BatchSchedule, spread_subset
from plumbing.cli import ArgumentParser, default_path, run
from plumbing.optimizers import lr_at, set_lr


@dataclass(frozen=True)
class Recipe:
    """One pretraining recipe. Defaults are the demo before the sweep (``OLD``)."""

    # model
    n_layers: int = 4
    emb_dim: int = 256
    n_heads: int = 4
    tie: bool = True  # output head = token embedding
    position_embedding: str = "learned"  # or "rope" (GPTConfig option: rotary, no position table)
    emb_std: float = 0.02  # init std of the token embedding (and of the tied head)
    zero_proj: bool = False  # zero-init the residual projections (attention out_proj, MLP down), as modded-nanogpt
    head_zero: bool = False  # zero-init an untied head (nanochat, modded-nanogpt)
    # data
    batch_size: int = 8
    block_len: int = 256
    steps: int = 240
    # optimisation
    optimizer: str = "adamw"  # or "muon": Muon on the blocks' 2-D weights, AdamW on the rest
    lr: float = 2e-3  # AdamW peak learning rate
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.1
    embedding_lr_scale: float = 1.0  # AdamW lr multiplier for the token (and tied head) embedding
    position_lr_scale: float = 1.0  # AdamW lr multiplier for the learned position table
    muon_lr: float = 0.02  # Muon peak learning rate (Keller Jordan's scaling: lr * sqrt(max(1, rows / cols)))
    muon_momentum: float = 0.95
    warmup: int = 20
    schedule: str = "cosine"  # "cosine" (lr_at), "linear" (linear decay), "wsd" (warm-up, stable, decay)
    cooldown: float = 0.3  # wsd: the last fraction of the steps decays linearly
    min_ratio: float = 0.1  # the schedule ends at min_ratio * peak
    bf16: bool = False  # torch.autocast(cpu, bfloat16) for forward and loss, as accelerate --mixed_precision bf16
    note: str = ""

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.block_len


OLD = Recipe(note="the demo before the sweep: AdamW 2e-3, 240 x 8 x 256, cosine, tied, fp32")
MUON = replace(OLD, optimizer="muon", note="")
M2 = replace(MUON, embedding_lr_scale=30.0)
M3 = replace(M2, position_embedding="rope")
M4 = replace(M3, bf16=True)
M5 = replace(M4, batch_size=16, block_len=128)
DEMO = replace(M5, steps=480, warmup=40)  # 0-PRETRAIN's demo defaults today: m5 for twice the tokens
# name -> (group, recipe). Groups are steps of the sweep; each changes one thing against its group's reference.
RECIPES = {
    "old": ("base", OLD),
    "demo": ("base", DEMO),
    "old-bf16": ("base", replace(OLD, bf16=True, note="the old demo under bf16 autocast")),
    # peak learning rate and schedule (AdamW)
    "lr1e-3": ("lr", replace(OLD, lr=1e-3)),
    "lr4e-3": ("lr", replace(OLD, lr=4e-3)),
    "lr8e-3": ("lr", replace(OLD, lr=8e-3)),
    "warmup5": ("lr", replace(OLD, warmup=5)),
    "warmup60": ("lr", replace(OLD, warmup=60)),
    "linear": ("lr", replace(OLD, schedule="linear", min_ratio=0.0)),
    "wsd": ("lr", replace(OLD, schedule="wsd", min_ratio=0.0)),
    # batch x context: same tokens, more optimizer steps per token
    "b4": ("batch", replace(OLD, batch_size=4, steps=480)),
    "b16-ctx128": ("batch", replace(OLD, batch_size=16, block_len=128)),
    "b8-ctx128": ("batch", replace(OLD, batch_size=8, block_len=128, steps=480)),
    "b16-ctx64": ("batch", replace(OLD, batch_size=16, block_len=64, steps=480)),
    # initialisation, embedding scale, tying, betas, decay
    "zero-proj": ("init", replace(OLD, zero_proj=True)),
    "emb-lr10": ("init", replace(OLD, embedding_lr_scale=10.0)),
    "untied": ("init", replace(OLD, tie=False)),
    "untied-zero-head": ("init", replace(OLD, tie=False, head_zero=True)),
    "betas0.8": ("init", replace(OLD, betas=(0.8, 0.95))),
    "wd0": ("init", replace(OLD, weight_decay=0.0)),
    # Muon for the 2-D weights of the blocks, AdamW for embeddings, head, norms, biases
    "muon": ("muon", replace(OLD, optimizer="muon")),
    "muon-lr0.01": ("muon", replace(OLD, optimizer="muon", muon_lr=0.01)),
    "muon-lr0.04": ("muon", replace(OLD, optimizer="muon", muon_lr=0.04)),
    "muon-adam4e-3": ("muon", replace(OLD, optimizer="muon", lr=4e-3)),
    "muon-adam8e-3": ("muon", replace(OLD, optimizer="muon", lr=8e-3)),
    # on top of Muon: embedding learning rate, untied zero-init head, zero-init projections, batch, betas, decay
    "m-emb-lr10": ("muon2", replace(MUON, embedding_lr_scale=10.0)),
    "m-emb-lr30": ("muon2", replace(MUON, embedding_lr_scale=30.0)),
    "m-untied-zero-head": ("muon2", replace(MUON, tie=False, head_zero=True)),
    "m-untied-zero-head-emb-lr30": ("muon2", replace(MUON, tie=False, head_zero=True, embedding_lr_scale=30.0)),
    "m-zero-proj": ("muon2", replace(MUON, zero_proj=True)),
    "m-b4": ("muon2", replace(MUON, batch_size=4, steps=480)),
    "m-betas0.8": ("muon2", replace(MUON, betas=(0.8, 0.95))),
    "m-wd0": ("muon2", replace(MUON, weight_decay=0.0)),
    "m-bf16": ("muon2", replace(MUON, bf16=True)),
    "m-rope": ("muon2", replace(MUON, position_embedding="rope")),
    "m-linear": ("muon2", replace(MUON, schedule="linear", min_ratio=0.0)),
    "m-wsd": ("muon2", replace(MUON, schedule="wsd", min_ratio=0.0)),
    # on top of Muon with the embedding at 30x the AdamW rate (the best of muon2)
    "m2-b4": ("m2", replace(M2, batch_size=4, steps=480)),
    "m2-linear": ("m2", replace(M2, schedule="linear", min_ratio=0.0)),
    "m2-adam4e-3": ("m2", replace(M2, lr=4e-3, muon_lr=0.02)),
    "m2-muon0.04": ("m2", replace(M2, muon_lr=0.04)),
    "m2-rope": ("m2", replace(M2, position_embedding="rope")),
    "m2-zero-proj": ("m2", replace(M2, zero_proj=True)),
    "m2-b16": ("m2", replace(M2, batch_size=16, steps=120)),
    "m2-2x": ("m2", replace(M2, steps=480, warmup=40)),
    "m2-pos-lr30": ("m2", replace(M2, position_lr_scale=30.0)),
    "m2-pos-lr10": ("m2", replace(M2, position_lr_scale=10.0)),
    "m2-wd0": ("m2", replace(M2, weight_decay=0.0)),
    "m2-l6": ("m2", replace(M2, n_layers=6)),
    "m2-l8": ("m2", replace(M2, n_layers=8)),
    "m2-e128": ("m2", replace(M2, emb_dim=128)),
    "m2-e128-2x": ("m2", replace(M2, emb_dim=128, steps=480)),
    # on top of m2 with rotary positions (the best of m2): run length, bf16, decay, init
    "m3-bf16": ("m3", replace(M3, bf16=True)),
    "m3-2x-bf16": ("m3", replace(M3, steps=480, warmup=40, bf16=True)),
    "m3-wd0": ("m3", replace(M3, weight_decay=0.0)),
    "m3-zero-proj": ("m3", replace(M3, zero_proj=True)),
    "m3-b16": ("m3", replace(M3, batch_size=16, steps=120)),
    # on top of m3 under bf16 autocast (what the stage now uses on this hardware): the next round
    "m4-emb100": ("m4", replace(M4, embedding_lr_scale=100.0)),
    "m4-emb10": ("m4", replace(M4, embedding_lr_scale=10.0)),
    "m4-betas0.8": ("m4", replace(M4, betas=(0.8, 0.95))),
    "m4-ctx128": ("m4", replace(M4, batch_size=16, block_len=128)),
    "m4-ctx64": ("m4", replace(M4, batch_size=32, block_len=64)),
    "m4-b16": ("m4", replace(M4, batch_size=16, steps=120, warmup=10)),
    "m4-muon0.03": ("m4", replace(M4, muon_lr=0.03)),
    "m4-warmup5": ("m4", replace(M4, warmup=5)),
    "m4-wsd": ("m4", replace(M4, schedule="wsd", min_ratio=0.0)),
    "m4-e384-l2": ("m4", replace(M4, emb_dim=384, n_heads=6, n_layers=2)),
    "m4-l3": ("m4", replace(M4, n_layers=3)),
    # on top of m4 with 16 blocks of 128 tokens per step (the best of m4): context, length, betas
    "m5-ctx64": ("m5", replace(M5, batch_size=32, block_len=64)),
    "m5-betas0.8": ("m5", replace(M5, betas=(0.8, 0.95))),
    "m5-2x": ("m5", DEMO),
    "m5-3x": ("m5", replace(M5, steps=720, warmup=60)),
    "m5-b32-2x": ("m5", replace(M5, batch_size=32, steps=240, warmup=20)),
    # model shape: a narrower or shallower model computes more tokens per second (the 21128-row head is most of
    # the work at emb 256); steps here are 240 x today's time per token / the shape's (measured with --time_only)
    "m-e128": ("shape", replace(MUON, emb_dim=128)),
    "m-e192": ("shape", replace(MUON, emb_dim=192)),
    "m-e256-l2": ("shape", replace(MUON, n_layers=2)),
    "m-e128-l6": ("shape", replace(MUON, emb_dim=128, n_layers=6)),
}


def load_tokens(args):
    """Train and val token streams (documents joined with [SEP], exactly ``token_cache.PackedBlocks.tokens``)."""
    from chinese_tokenizer import load_tokenizer
    from plumbing.documents import load_text_documents
    from plumbing.token_cache import PackedBlocks

    tokenizer = load_tokenizer(args.tokenizer)
    train = PackedBlocks(load_text_documents(args.train_files, "--train_files"), tokenizer, 256, "train")
    val = PackedBlocks(load_text_documents(args.val_files, "--val_files"), tokenizer, 256, "val")
    return train.tokens, val.tokens


def block_batch(tokens: np.ndarray, block_len: int, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``indices`` of a token stream, as ``PackedBlocks.collate`` cuts them: (B, L) inputs, (B, L) labels."""
    rows = np.stack([tokens[i * block_len:i * block_len + block_len + 1] for i in indices]).astype(np.int64)
    rows = torch.from_numpy(rows)  # (B, L + 1)
    return rows[:, :-1], rows[:, 1:]


def build_model(r: Recipe) -> GPTModel:
    """PRESETS["demo"] with the recipe's shape, seeded as the stage seeds it, then the recipe's init changes."""
    cfg = get_preset("demo").replace(n_layers=r.n_layers, emb_dim=r.emb_dim, n_heads=r.n_heads,
                                     tie_embeddings=r.tie, position_embedding=r.position_embedding)
    model = GPTModel(cfg)
    with torch.no_grad():
        if r.emb_std != 0.02:
            nn.init.normal_(model.tok_emb.weight, std=r.emb_std)
        if r.zero_proj:
            for name, p in model.named_parameters():
                if name.endswith("out_proj.weight") or name.endswith("layers.2.weight"):
                    p.zero_()
        if r.head_zero and not r.tie:
            model.out_head.weight.zero_()
    return model


def build_optimizer(model: GPTModel, r: Recipe) -> torch.optim.Optimizer:
    """AdamW groups as optimizers.make_optimizer builds them, or Muon + AdamW in one optimizer (``optimizer="muon"``).

    Each group's ``lr_scale`` multiplies the schedule's learning rate in ``set_lr``.
    """
    from plumbing.optimizers import make_optimizer

    if r.optimizer == "adamw" and r.embedding_lr_scale == r.position_lr_scale == 1.0 and r.betas == (0.9, 0.95):
        return make_optimizer(model, r.lr, r.weight_decay)
    from plumbing.optimizers import MuonAdamW, make_optimizer_groups

    groups = make_optimizer_groups(model, r.weight_decay, muon=r.optimizer == "muon",
                                   embedding_lr_scale=r.embedding_lr_scale, muon_lr_scale=r.muon_lr / r.lr)
    if r.position_lr_scale != 1.0 and model.pos_emb is not None:  # the position table in a group of its own
        position = model.pos_emb.weight
        for g in groups:
            g["params"] = [p for p in g["params"] if p is not position]
        groups.append({"params": [position], "weight_decay": 0.0, "lr_scale": r.position_lr_scale})
    return MuonAdamW(groups, lr=r.lr, betas=r.betas, muon_momentum=r.muon_momentum)


def schedule_lr(r: Recipe, step: int) -> float:
    """Learning rate of step ``step`` (0-based) for the recipe's schedule, all with a linear warm-up."""
    if r.schedule == "cosine":
        return lr_at(step, r.lr, r.warmup, r.steps, r.min_ratio)
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    if r.schedule == "linear":
        progress = (step - r.warmup) / max(1, r.steps - r.warmup)
    elif r.schedule == "wsd":
        decay_start = r.steps - int(r.cooldown * r.steps)
        progress = max(0.0, (step - decay_start) / max(1, r.steps - decay_start))
    else:
        raise ValueError(f"unknown schedule {r.schedule!r}")
    return r.lr * (1.0 - (1.0 - r.min_ratio) * min(1.0, progress))


@torch.no_grad()
def val_loss(model, tokens, r: Recipe, blocks) -> float:
    """Mean next-token loss over val blocks ``blocks`` (as training.evaluate_lm: eval mode, same autocast)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), 16):
        x, y = block_batch(tokens, r.block_len, blocks[start:start + 16])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r.bf16):
            total += model(x, labels=y)["loss"].item() * y.numel()
        count += y.numel()
    model.train()
    return total / count


def train(name: str, r: Recipe, train_tokens, val_tokens, args) -> dict:
    """One run of recipe ``r``; returns its row (val losses at four points, seconds, tokens/s)."""
    torch.manual_seed(args.seed)  # the stage: accelerate.utils.set_seed(args.seed) before the model is built
    np.random.seed(args.seed)
    model = build_model(r)
    optimizer = build_optimizer(model, r)
    n_train = (len(train_tokens) - 1) // r.block_len
    n_val = (len(val_tokens) - 1) // r.block_len
    subset = spread_subset(n_val, max(1, args.eval_tokens // r.block_len))
    schedule = BatchSchedule(n_train, r.batch_size, 1, 1, args.seed)
    steps = args.time_only if args.time_only else r.steps
    evals = {} if args.time_only else {round(r.steps * k / 4): None for k in (1, 2, 3, 4)}
    seconds, cpu_seconds, curve = 0.0, 0.0, []
    model.train()
    for step in range(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        set_lr(optimizer, schedule_lr(r, step))
        x, y = block_batch(train_tokens, r.block_len, schedule.indices(step, 0, 0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r.bf16):
            loss = model(x, labels=y)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()
        if args.time_only and step < 2:
            continue  # the first steps allocate and warm up: not timed
        seconds += time.perf_counter() - started
        cpu_seconds += time.process_time() - cpu_started
        if not math.isfinite(loss):
            print(f"  {name}: loss {loss} at step {step + 1}; stopped")
            break
        if step + 1 in evals:
            evals[step + 1] = val_loss(model, val_tokens, r, subset)
            curve.append((step + 1, (step + 1) * r.batch_size * r.block_len, round(seconds, 1), evals[step + 1]))
            print(f"  {name}: step {step + 1}, {curve[-1][1]:,} tokens, {seconds:.0f} s, train loss {loss:.3f}, "
                  f"val loss {evals[step + 1]:.3f}", flush=True)
    timed_steps = steps - 2 if args.time_only else steps
    row = {"name": name, "recipe": asdict(r), "tokens": r.tokens, "train_seconds": round(seconds, 1),
           "cpu_seconds": round(cpu_seconds, 1),
           "tokens_per_cpu_s": round(timed_steps * r.batch_size * r.block_len / max(cpu_seconds, 1e-9)),
           "tokens_per_s": round(timed_steps * r.batch_size * r.block_len / max(seconds, 1e-9)),
           "params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads(),
           "load_average": round(os.getloadavg()[0], 2)}
    if not args.time_only:
        row["curve"] = curve
        row["val_loss_all"] = round(val_loss(model, val_tokens, r, list(range(n_val))), 4)
    return row


def describe(r: Recipe) -> str:
    """The fields of ``r`` that differ from ``OLD``."""
    changed = {k: v for k, v in asdict(r).items() if k != "note" and v != getattr(OLD, k)}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "(the old demo)"


def print_table(path: str) -> None:
    """The rows of a results file (the last row of each recipe that was trained, not only timed) as markdown."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for row in map(json.loads, f):
            if "curve" in row:
                rows[row["name"]] = row
    print("| recipe | changed from `old` | tokens | val loss at 1/4, 1/2, 3/4, end | all val |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        r = Recipe(**{**row["recipe"], "betas": tuple(row["recipe"]["betas"])})
        losses = ", ".join(f"{c[3]:.3f}" for c in row["curve"])
        print(f"| {name} | {describe(r)} | {row['tokens'] / 1e6:.2f}M | {losses} | {row['val_loss_all']:.3f} |")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("names", nargs="*", help="recipes to run, in order (see --list)")
    p.add_argument("--group", help="run every recipe of this group (see --list)")
    p.add_argument("--list", action="store_true", help="print the recipes and exit")
    p.add_argument("--table", action="store_true", help="print the rows of --results as a markdown table and exit")
    p.add_argument("--time_only", type=int, nargs="?", const=12, default=0,
                   help="only time this many steps (the first 2 untimed) and print tokens/s")
    p.add_argument("--eval_tokens", type=int, default=48 * 256,
                   help="val predictions of the four evaluations during a run (the demo stage: 96 blocks of 128)")
    p.add_argument("--seed", type=int, default=1234, help="the stage's --seed")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core); on a machine shared "
                   "with other work, 1 thread wastes less time waiting for a busy core (the losses stay comparable)")
    p.add_argument("--results", default=os.path.join("/tmp", "sweep_pretrain.jsonl"),
                   help="JSON lines file the rows are appended to")
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "pretrain", "train.jsonl")])
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "pretrain", "val.jsonl")])
    p.add_argument("--tokenizer", default=default_path("data", "tokenizer"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for name, (group, r) in RECIPES.items():
            note = r.note if r is OLD or r.note != OLD.note else ""
            print(f"{group:<7} {name:<18} {r.tokens / 1e6:.2f}M tokens  {describe(r)}  {note}")
        return 0
    if args.table:
        print_table(args.results)
        return 0
    names = list(args.names) + [n for n, (g, _) in RECIPES.items() if g == args.group]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        print(f"error: give recipe names or --group (unknown: {unknown}); see --list", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    train_tokens, val_tokens = load_tokens(args)
    print(f"train {len(train_tokens):,} tokens, val {len(val_tokens):,}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    rows = []
    for name in names:
        r = RECIPES[name][1]
        print(f"{name}: {describe(r)}", flush=True)
        row = train(name, r, train_tokens, val_tokens, args)
        rows.append(row)
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'recipe':<18} {'tokens':>7} {'train s':>8} {'tok/s':>7} {'tok/cpu-s':>9} {'load':>5}  "
          f"val loss at 1/4 1/2 3/4 end, all val")
    for row in rows:
        losses = " ".join(f"{c[3]:.3f}" for c in row.get("curve", []))
        print(f"{row['name']:<18} {row['tokens'] / 1e6:6.2f}M {row['train_seconds']:8.1f} {row['tokens_per_s']:7,} "
              f"{row['tokens_per_cpu_s']:9,} {row['load_average']:5.2f}  {losses}  "
              f"{row.get('val_loss_all', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    run(main)
