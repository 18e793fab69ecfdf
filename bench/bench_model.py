"""Our GPTModel against transformers' GPT2LMHeadModel: same config, same weights, same work, measured in one run.

Both models are built from one ``GPTConfig`` preset (``demo`` by default); our freshly initialised weights are
copied into the Hugging Face model, and the logits of the two are compared before anything is timed. Every figure
is measured alternately (ours, theirs, theirs, ours, ...) so that noise from other work on the machine falls on
both sides alike, and the table reports medians and the ratio ours / transformers.

What is measured (see bench/README.md for what each figure means):
  train   forward + next-token loss + backward + AdamW step, tokens/s, in fp32 and under bf16 autocast
  eval    forward + loss without gradients, tokens/s
  gen     greedy generation of exactly --gen-tokens new tokens at batch 1 and batch 8, tokens/s
          (ours: gpt_fast.generate with its KV cache; theirs: model.generate(do_sample=False, use_cache=True))
  latency time of single cached decoding steps at new token 10 and new token 900 of one long generation
          (the preset's shape with context_length=1024)
  memory  peak resident memory of each workload in a fresh process (CPU) or peak allocated memory (CUDA)
  GFLOP/s model FLOPs per second against a large matmul's rate measured in the same run

Run ``python bench/bench_model.py --help`` for the options; the defaults take a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpt_fast import generate, speed_up
from gpt_model import PRESETS, GPTModel, get_preset
from plumbing.cli import HelpFormatter
from plumbing.hf_weights import gpt_to_hf_state_dict, hf_config_from_gpt

PROMPT_LEN = 16  # tokens of the random prompt that every generation starts from


# ----------------------------------------------------------------------------------------------- the twin model

def build_models(cfg, device, seed=0, which=("ours", "hf")):
    """Our model initialised from ``seed`` and, when asked for, its transformers twin with the same weights
    (through ``plumbing.hf_weights``: GPT-2 for learned positions, GPT-NeoX for the demo's rotary ones)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    ours = speed_up(GPTModel(cfg))  # as the stages run it
    models = {}
    if "hf" in which:
        config = hf_config_from_gpt(cfg)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))  # default attention (sdpa)
        missing, unexpected = hf.load_state_dict(gpt_to_hf_state_dict(ours)[0], strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise SystemExit(f"bench: weight mapping mismatch: missing {missing}, unexpected {unexpected}")
        hf.generation_config = generation_config(1)
        models["hf"] = hf.to(device)
    if "ours" in which:
        models["ours"] = ours.to(device)
    return models


def generation_config(new_tokens):
    """Greedy, KV cache on, no end-of-sequence token: every row produces exactly ``new_tokens`` tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                            eos_token_id=None, bos_token_id=None, pad_token_id=0)


@torch.no_grad()
def check_same_outputs(models, cfg, device):
    """Logits and loss of the two models on the same batch agree (fp32, eval mode); returns the largest gap."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, min(64, cfg.context_length)), generator=g).to(device)
    ours, hf = models["ours"].eval(), models["hf"].eval()
    our_logits = ours(ids)["logits"]
    out = hf(input_ids=ids, labels=ids)
    gap = (our_logits - out.logits).abs().max().item()
    our_loss = ours(ids, labels=shifted_labels(ids))["loss"]  # the loss the timed runs use
    loss_gap = abs(our_loss.item() - out.loss.item())
    if gap > 1e-4 or loss_gap > 1e-5:
        raise SystemExit(f"bench: our logits differ from transformers' by {gap:.2e} (loss by {loss_gap:.2e}); "
                         "the weight mapping or the model is wrong, so the timings would compare different models")
    return gap, loss_gap


def shifted_labels(ids):
    """labels[:, t] = ids[:, t + 1], and -100 (ignored) at the last position: what transformers does with labels=ids."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


# --------------------------------------------------------------------------------------------------- workloads

def autocast(device, dtype):
    if dtype == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Workloads:
    """One callable per (workload, model) that does the work once; the same inputs for both models."""

    def __init__(self, models, cfg, args):
        self.models, self.cfg, self.args = models, cfg, args
        g = torch.Generator().manual_seed(2)
        self.train_ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=g).to(args.device)
        self.train_labels = shifted_labels(self.train_ids)
        self.prompts = {b: torch.randint(672, cfg.vocab_size, (b, PROMPT_LEN), generator=g).to(args.device)
                        for b in (1, 8)}
        self.optimizers = {}

    def optimizer(self, name):
        if name not in self.optimizers:
            # the same optimizer for both models; fused=True is one kernel over all parameters instead of a Python
            # loop of ~10 element-wise ops per parameter (the default on CPU)
            self.optimizers[name] = torch.optim.AdamW(self.models[name].parameters(), lr=1e-4, weight_decay=0.1,
                                                      fused=self.args.fused_adamw)
        return self.optimizers[name]

    def train(self, name, dtype):
        model, opt, ids = self.models[name], self.optimizer(name), self.train_ids
        model.train()
        with autocast(self.args.device, dtype):
            if name == "ours":
                loss = model(ids, labels=self.train_labels)["loss"]
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def eval(self, name, dtype):
        model, ids = self.models[name], self.train_ids
        model.eval()
        with autocast(self.args.device, dtype):
            if name == "ours":
                model(ids, labels=self.train_labels)["loss"].item()
            else:
                model(input_ids=ids, labels=ids).loss.item()

    def generate(self, name, dtype, batch, new_tokens, streamer=None):
        model, prompt = self.models[name], self.prompts[batch]
        model.eval()
        with autocast(self.args.device, dtype), torch.no_grad():
            if name == "ours":
                out = generate(model, prompt, new_tokens, context_size=self.cfg.context_length, stream=streamer)
            else:
                out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                     generation_config=generation_config(new_tokens), streamer=streamer)
        assert out.shape == (batch, PROMPT_LEN + new_tokens), out.shape
        return out


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(fns, repeats, device, warmup=1):
    """Seconds per call of each fn, measured alternately (A B B A A B ...); returns {name: [seconds, ...]}."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(fns[name], device))
    return times


class StepClock:
    """A generation streamer for both APIs that notes the time each new token arrives."""

    def __init__(self, device, skip_first_put=False):
        self.device, self.stamps, self.skip = device, [], skip_first_put

    def __call__(self, _tokens):  # gpt_fast.generate calls stream(next_ids)
        sync(self.device)
        self.stamps.append(time.perf_counter())

    def put(self, value):  # transformers calls put(prompt) once, then put(next_ids) per step
        if self.skip:
            self.skip = False
            return
        self(value)

    def end(self):
        pass


# ------------------------------------------------------------------------------------------------------- FLOPs

def matmul_params(cfg):
    """Weights that take part in a matmul for every token: the blocks' projections and the output head."""
    per_block = 4 * cfg.emb_dim * cfg.emb_dim + 2 * 4 * cfg.emb_dim * cfg.emb_dim  # q, k, v, out; two FF layers
    return cfg.n_layers * per_block + cfg.vocab_size * cfg.emb_dim


def train_flops_per_token(cfg, seq_len):
    """6 N plus attention's 6 * 2 * L * T * E (scores and weighted sum, forward and backward; causal not halved)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * seq_len * cfg.emb_dim


def infer_flops_per_token(cfg, context):
    """2 N plus 2 * 2 * L * context * E for attention over ``context`` keys."""
    return 2 * matmul_params(cfg) + 4 * cfg.n_layers * context * cfg.emb_dim


def matmul_peak(device, dtype, size=2048, repeats=5):
    """GFLOP/s of a large square ``torch.mm``: the practical ceiling for this machine and precision."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dt)
    b = torch.randn(size, size, device=device, dtype=dt)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b), device) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


# ------------------------------------------------------------------------------------------------------ memory

def rss_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def memory_child(args):
    """In a fresh process: build one model, run one workload twice, print its peak memory above the resting model."""
    cfg = bench_config(args)
    models = build_models(cfg, args.device, which=(args.memory_child[0],))
    name, workload, dtype = args.memory_child
    work = Workloads(models, cfg, args)
    run = {"train": lambda: work.train(name, dtype), "eval": lambda: work.eval(name, dtype),
           "gen1": lambda: work.generate(name, dtype, 1, args.gen_tokens),
           "gen8": lambda: work.generate(name, dtype, 8, args.gen_tokens)}[workload]
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(), run()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark VmHWM to the current RSS
        run(), run()
        peak = rss_kib("VmHWM") * 1024 - base
    print(json.dumps({"peak_bytes": peak}))


def measure_memory(args, name, workload, dtype):
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--memory-child", name, workload, dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"] / 2 ** 20


# -------------------------------------------------------------------------------------------------------- main

def bench_config(args, context_length=None):
    """The preset's config, with learned positions if it uses rotary ones (GPT2LMHeadModel has only a table)."""
    cfg = get_preset(args.preset).replace(position_embedding="learned")
    if context_length is not None:
        cfg = cfg.replace(context_length=context_length)
    return cfg


class Table:
    def __init__(self):
        self.rows = []

    def add(self, what, unit, ours, theirs, higher_is_better=True):
        self.rows.append((what, unit, ours, theirs))

    def print(self):
        head = f"{'measurement':<44} {'unit':<10} {'ours':>10} {'transformers':>13} {'ours/hf':>8}"
        print(head)
        print("-" * len(head))
        for what, unit, ours, theirs in self.rows:
            ratio = ours / theirs if theirs else float("nan")
            print(f"{what:<44} {unit:<10} {fmt(ours):>10} {fmt(theirs):>13} {ratio:>8.2f}")


def fmt(x):
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="demo", choices=list(PRESETS), help="model size from gpt_model.PRESETS")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="both", choices=["fp32", "bf16", "both"],
                        help="precision of training and eval (bf16 = autocast); generation runs in fp32 unless bf16")
    parser.add_argument("--batch-size", type=int, default=4, help="training/eval batch")
    parser.add_argument("--seq-len", type=int, default=None, help="training/eval tokens per row (default: context)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per figure (medians are reported)")
    parser.add_argument("--train-steps", type=int, default=2, help="training steps per timed round")
    parser.add_argument("--gen-tokens", type=int, default=200, help="new tokens per generation")
    parser.add_argument("--long-tokens", type=int, default=1000, help="new tokens of the latency run (0 skips it)")
    parser.add_argument("--long-repeats", type=int, default=2, help="rounds of the latency run")
    parser.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=True,
                        help="AdamW(fused=True) for both models")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--only", default="train,eval,gen,latency",
                        help="comma-separated subset of train, eval, gen, latency")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    return parser.parse_args()


def describe_machine(cfg, args) -> None:
    """The CPU (and GPU), core and thread counts, library versions and the model's size, on two lines."""
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, AttributeError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    if torch.device(args.device).type == "cuda":
        cpu += f"; GPU {torch.cuda.get_device_name()}"
    print(f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}")
    print(f"preset {args.preset}: {cfg.n_layers} layers, emb_dim {cfg.emb_dim}, {cfg.n_heads} heads, "
          f"vocab {cfg.vocab_size}, context {cfg.context_length}; device {args.device}")


def time_training(work, cfg, args, dtypes, peaks, table, flops) -> None:
    """Training tokens/s and GFLOP/s of both models, per precision, into ``table`` and ``flops``."""
    steps, tokens = args.train_steps, args.batch_size * args.seq_len
    for dt in dtypes:
        def train_fn(name, dt=dt):
            return lambda: [work.train(name, dt) for _ in range(steps)]
        t = interleaved({n: train_fn(n) for n in ("ours", "hf")}, args.repeats, args.device)
        rate = {n: steps * tokens / statistics.median(t[n]) for n in t}
        table.add(f"train tokens/s, {dt} (B={args.batch_size}, T={args.seq_len})", "tokens/s", rate["ours"], rate["hf"])
        f = train_flops_per_token(cfg, args.seq_len)
        flops.add(f"train {dt}: GFLOP/s ({100 * rate['ours'] * f / 1e9 / peaks[dt]:.0f}% of mm peak for ours)",
                  "GFLOP/s", rate["ours"] * f / 1e9, rate["hf"] * f / 1e9)
        print(f"  train {dt} done", flush=True)


def time_evaluation(work, cfg, args, dtypes, peaks, table, flops) -> None:
    """Evaluation (forward only) tokens/s and GFLOP/s of both models, per precision."""
    tokens = args.batch_size * args.seq_len
    for dt in dtypes:
        t = interleaved({n: (lambda n=n: work.eval(n, dt)) for n in ("ours", "hf")}, args.repeats, args.device)
        rate = {n: tokens / statistics.median(t[n]) for n in t}
        table.add(f"eval tokens/s, {dt} (B={args.batch_size}, T={args.seq_len})", "tokens/s", rate["ours"], rate["hf"])
        f = infer_flops_per_token(cfg, args.seq_len / 2)
        flops.add(f"eval {dt}: GFLOP/s ({100 * rate['ours'] * f / 1e9 / peaks[dt]:.0f}% of mm peak for ours)",
                  "GFLOP/s", rate["ours"] * f / 1e9, rate["hf"] * f / 1e9)
        print(f"  eval {dt} done", flush=True)


def time_generation(work, cfg, args, gen_dtype, peaks, table, flops) -> None:
    """Greedy generation tokens/s at batch 1 and 8, and whether both models wrote the same tokens."""
    outputs = {}
    for batch in (1, 8):
        def gen_fn(name, batch=batch):
            return lambda: outputs.__setitem__((name, batch), work.generate(name, gen_dtype, batch, args.gen_tokens))
        t = interleaved({n: gen_fn(n) for n in ("ours", "hf")}, args.repeats, args.device)
        rate = {n: batch * args.gen_tokens / statistics.median(t[n]) for n in t}
        same = (outputs[("ours", batch)] == outputs[("hf", batch)]).float().mean().item()
        table.add(f"generate tokens/s, batch {batch}, {args.gen_tokens} new, {gen_dtype}", "tokens/s",
                  rate["ours"], rate["hf"])
        f = infer_flops_per_token(cfg, PROMPT_LEN + args.gen_tokens / 2)
        flops.add(f"generate batch {batch}: GFLOP/s ({100 * rate['ours'] * f / 1e9 / peaks[gen_dtype]:.1f}% of "
                  "peak)", "GFLOP/s", rate["ours"] * f / 1e9, rate["hf"] * f / 1e9)
        print(f"  generate batch {batch} done (greedy tokens identical to transformers: {100 * same:.1f}%)",
              flush=True)


def time_latency(cfg, args, gen_dtype, table) -> dict:
    """Per-token latency at new token 10 and near token 900 of one long generation: {k: {"ours", "hf"}} in ms."""
    long_cfg = bench_config(args, context_length=max(cfg.context_length, PROMPT_LEN + args.long_tokens))
    long_work = Workloads(build_models(long_cfg, args.device), long_cfg, args)
    gaps = {"ours": [], "hf": []}
    for r in range(args.long_repeats + 1):  # the first round warms up
        for name in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
            clock = StepClock(args.device, skip_first_put=(name == "hf"))
            long_work.generate(name, gen_dtype, 1, args.long_tokens, streamer=clock)
            if r > 0:
                gaps[name].append([b - a for a, b in zip(clock.stamps, clock.stamps[1:])])

    def at(name, k):  # median over rounds and over new tokens k-2 .. k+2 (gap i ends at new token i + 2)
        return 1e3 * statistics.median([g[i] for g in gaps[name] for i in range(k - 4, k + 1)])
    latency = {}
    for k in (10, min(900, args.long_tokens - 3)):
        latency[k] = {n: at(n, k) for n in gaps}
        table.add(f"latency at new token {k}, batch 1, context {long_cfg.context_length}", "ms/token",
                  latency[k]["ours"], latency[k]["hf"])
    print("  latency done", flush=True)
    return latency


def measure_memories(args, only, dtypes, gen_dtype) -> Table:
    """Peak memory above the resting model of each timed workload, in subprocesses, for both models."""
    memory = Table()
    jobs = [("train", dt) for dt in dtypes if "train" in only] + [("eval", dt) for dt in dtypes if "eval" in only]
    jobs += [("gen1", gen_dtype), ("gen8", gen_dtype)] if "gen" in only else []
    kind = "peak allocated" if torch.device(args.device).type == "cuda" else "peak RSS"
    for workload, dt in jobs:
        mem = {n: measure_memory(args, n, workload, dt) for n in ("ours", "hf")}
        memory.add(f"{workload} {dt}: {kind} above the resting model", "MiB", mem["ours"], mem["hf"])
    print("  memory done", flush=True)
    return memory


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args)
    args.seq_len = args.seq_len or cfg.context_length
    if args.memory_child:
        return memory_child(args)
    only = set(args.only.split(","))
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    gen_dtype = "bf16" if args.dtype == "bf16" else "fp32"
    started = time.perf_counter()
    describe_machine(cfg, args)

    models = build_models(cfg, args.device)
    gap, loss_gap = check_same_outputs(models, cfg, args.device)
    print(f"same weights: max |logits ours - transformers| = {gap:.2e}, |loss gap| = {loss_gap:.2e} "
          f"(attention in transformers: {models['hf'].config._attn_implementation})")
    peaks = {dt: matmul_peak(args.device, dt) for dt in dtypes + [gen_dtype]}
    print("matmul peak (2048^3 torch.mm): " + ", ".join(f"{dt} {p:,.0f} GFLOP/s" for dt, p in peaks.items()))
    print()

    table, flops = Table(), Table()
    if "train" in only:
        time_training(Workloads(models, cfg, args), cfg, args, dtypes, peaks, table, flops)
        models = build_models(cfg, args.device)  # training changed the weights differently: identical twins again
    work = Workloads(models, cfg, args)
    if "eval" in only:
        time_evaluation(work, cfg, args, dtypes, peaks, table, flops)
    if "gen" in only:
        time_generation(work, cfg, args, gen_dtype, peaks, table, flops)
    latency = time_latency(cfg, args, gen_dtype, table) if "latency" in only and args.long_tokens > 0 else {}
    memory = measure_memories(args, only, dtypes, gen_dtype) if not args.no_memory else Table()

    print()
    table.print()
    print()
    flops.print()
    if memory.rows:
        print()
        memory.print()
    if latency:
        k2 = max(latency)
        print(f"\nlatency growth, token {k2} / token 10: ours {latency[k2]['ours'] / latency[10]['ours']:.2f}, "
              f"transformers {latency[k2]['hf'] / latency[10]['hf']:.2f}")
    print(f"\ncommand: python {' '.join(['bench/bench_model.py', *sys.argv[1:]])}  "
          f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
