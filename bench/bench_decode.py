"""Decoding against its physical limit: each cached decode step must read every weight once (and the KV cache), so
its time cannot drop below (bytes read per step) / (read bandwidth). This bench measures both in one run.

For each preset, weight dtype (fp32, bf16, and fp32 under bf16 autocast) and batch size it reports:
  step     median time of one cached decode step of ``gpt_fast.generate`` (greedy, new tokens 4 .. N)
  bytes    weights read per step (every block matrix, the final norm, the whole output head, B embedding rows)
           plus the keys and values read from the cache at the measured positions
  bound    bytes / read bandwidth, where the bandwidth is that of ``torch.sum`` over a buffer of the same size,
           measured here with the same threads (a working set that fits in the CPU's last-level cache is bounded
           by the cache's bandwidth, not DRAM's; the DRAM figure over 1 GiB is printed too)
  ratio    step / bound: 1.0 is the limit
and the agreement of bf16 weights with fp32 (greedy tokens equal before the first difference, first-step logits),
and the step time at new token 900 over the step time at new token 10 (context 1024).

    python bench/bench_decode.py                          # demo and gpt2-zh-small, fp32 and bf16, batch 1 and 8
    python bench/bench_decode.py --presets demo --batches 1
    python bench/bench_decode.py --presets demo --batches 1 --ops  # also what each operation of a step costs
    python bench/bench_decode.py --split_vs_linear --batches 1 8 32 64 128   # gpt_fast.SplitLinear's split path on/off
    python bench/bench_decode.py --decode_step_vs_general --batches 1 8 64   # FastGPTModel.decode_step on/off

The figures go in bench/README.md ("Decoding against the memory bound").
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import cpu_name

import gpt_fast
from gpt_fast import generate, speed_up
from gpt_model import GPTModel, apply_rope, get_preset, rope_angles
from plumbing.cli import HelpFormatter

PROMPT_LEN = 16
# "autocast": fp32 weights decoded under CPU bf16 autocast, as the alignment stages sample (autocast keeps one bf16
# copy of each weight for the whole generate call, so a step reads bf16 weights)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "autocast": torch.float32}


def read_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes per second that ``torch.sum`` reads from an fp32 buffer of ``nbytes`` (best of ``repeats`` after a
    warm-up pass, as a decode step re-reads the same weights)."""
    buf = torch.ones(max(nbytes // 4, 1024), dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def weight_bytes_per_step(model: GPTModel, batch: int) -> int:
    """Bytes of weights one decode step reads: all parameters, except that an untied token-embedding table
    contributes only its B gathered rows (a tied one is read whole by the output head)."""
    cfg, total = model.cfg, 0
    for name, p in model.named_parameters():
        if name == "tok_emb.weight" and not cfg.tie_embeddings:
            total += batch * p.shape[1] * p.element_size()
        elif name == "pos_emb.weight":
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_step(cfg, batch: int, positions: float, element_size: int) -> float:
    """Keys and values read by attention at a step that sees ``positions`` cached tokens."""
    return 2 * cfg.n_layers * batch * positions * cfg.emb_dim * element_size


def step_times(model, batch: int, new_tokens: int, seed: int = 0) -> list[float]:
    """Seconds of each cached decode step of one greedy generation (the first, full-prompt step left out)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, model.cfg.vocab_size, (batch, PROMPT_LEN), generator=g)
    stamps = []
    generate(model, idx, new_tokens, model.cfg.context_length, stream=lambda _: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps, stamps[1:])]


def measure(model, batch: int, new_tokens: int, rounds: int, autocast: bool = False,
            inference_mode: bool = False) -> float:
    """Median decode-step time over ``rounds`` generations, steps 4 .. new_tokens (warmed up), under CPU bf16
    autocast when asked, and inside ``torch.inference_mode()`` when asked (where generate used to run: autocast
    then keeps no bf16 copies of the weights and casts them again at every step)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.inference_mode(inference_mode):
        step_times(model, batch, 8)
        times = []
        for r in range(rounds):
            times += step_times(model, batch, new_tokens, seed=r)[2:]
    return statistics.median(times)


def agreement(fp32_model, bf16_model, prompts: int, new_tokens: int) -> dict:
    """How bf16 weights compare with fp32: greedy tokens equal before the first difference (mean over prompts),
    and the first step's logits (max absolute difference, and the share of prompts whose top token agrees)."""
    g = torch.Generator().manual_seed(123)
    idx = torch.randint(1, fp32_model.cfg.vocab_size, (prompts, PROMPT_LEN), generator=g)
    a = generate(fp32_model, idx, new_tokens, fp32_model.cfg.context_length)[:, PROMPT_LEN:]
    b = generate(bf16_model, idx, new_tokens, bf16_model.cfg.context_length)[:, PROMPT_LEN:]
    same = []
    for row_a, row_b in zip(a.tolist(), b.tolist()):
        n = next((i for i, (x, y) in enumerate(zip(row_a, row_b)) if x != y), len(row_a))
        same.append(n)
    with torch.inference_mode():
        la = fp32_model(idx)["logits"][:, -1].float()
        lb = bf16_model(idx)["logits"][:, -1].float()
    return {"tokens_before_difference": statistics.mean(same), "of": new_tokens,
            "logits_max_abs_diff": float((la - lb).abs().max()), "logits_scale": float(la.abs().max()),
            "top1_agree": float((la.argmax(-1) == lb.argmax(-1)).float().mean())}


def op_time(fn, calls: int = 400, repeats: int = 5) -> float:
    """Seconds per call of ``fn()`` alone, back to back (median of ``repeats`` loops of ``calls``, warmed up)."""
    for _ in range(20):
        fn()
    loops = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - t) / calls)
    return statistics.median(loops)


def operation_costs(model: GPTModel, cached: int = 40) -> list[tuple[str, int, float, int]]:
    """What the operations of one batch-1 decode step cost when each is timed alone: rows of (operation, calls
    per step, seconds per call, bytes of weights it reads), with the model's own modules and dtype, ``cached``
    positions in the cache. Their sum is a floor for an eager step that runs them one by one (it leaves out
    Python, views, the cache writes and the module calls around them)."""
    cfg, block = model.cfg, model.trf_blocks[0]
    dtype, d_h, layers = model.tok_emb.weight.dtype, cfg.emb_dim // cfg.n_heads, cfg.n_layers
    x = torch.randn(1, 1, cfg.emb_dim, dtype=dtype)  # (B, T, E)
    wide = torch.randn(1, 1, 4 * cfg.emb_dim, dtype=dtype)  # (B, T, 4E)
    q = torch.randn(1, cfg.n_heads, 1, d_h, dtype=dtype)  # (B, H, 1, d_h)
    kv = torch.randn(1, cfg.n_heads, cached, d_h, dtype=dtype)  # (B, H, Tk, d_h)
    logits = torch.randn(1, cfg.vocab_size)  # (B, V), fp32 as generate makes them
    up, down = block.ff.layers[0], block.ff.layers[2]
    def size(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())

    rows = [("q/k/v projection (E -> E)", 3 * layers, block.att.W_query, x, size(block.att.W_query)),
            ("attention output projection (E -> E)", layers, block.att.out_proj, x, size(block.att.out_proj)),
            ("feed-forward up (E -> 4E)", layers, up, x, size(up)),
            ("feed-forward down (4E -> E)", layers, down, wide, size(down)),
            ("output head (E -> V)", 1, model.out_head, x, size(model.out_head))]
    with torch.no_grad():
        out = [(name, n, op_time(lambda m=m, a=a: m(a)), nbytes) for name, n, m, a, nbytes in rows]
        out += [("norm", 2 * layers + 1, op_time(lambda: block.norm1(x)), 0),
                ("GELU (4E)", layers, op_time(lambda: block.ff.layers[1](wide)), 0),
                ("residual add", 2 * layers, op_time(lambda: x + x), 0),
                (f"scaled_dot_product_attention (1 query, {cached} keys)", layers,
                 op_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv)), 0),
                ("argmax over the vocabulary", 1, op_time(lambda: logits.argmax(dim=-1)), 0),
                ("(amax over the vocabulary, for scale)", 0, op_time(lambda: logits.amax(dim=-1)), 0)]
        if cfg.position_embedding == "rope":
            rotation = rope_angles(d_h, torch.tensor([[cached]]))
            out.append(("rotary embedding (q or k)", 2 * layers, op_time(lambda: apply_rope(q, rotation)), 0))
    return out


def print_operation_costs(preset: str, dtype: str, model: GPTModel, bandwidth: float) -> None:
    """The ``operation_costs`` table, with each matrix product's time at the bandwidth of the step's weights."""
    rows = operation_costs(model)
    print(f"\n{preset}, {dtype} weights, batch 1: each operation of a decode step timed alone\n")
    print("| operation | per step | µs each | µs per step | µs at the read bandwidth |")
    print("|---|---|---|---|---|")
    for name, n, seconds, nbytes in rows:
        bound = f"{n * nbytes / bandwidth * 1e6:.0f}" if nbytes else ""
        print(f"| {name} | {n} | {seconds * 1e6:.1f} | {n * seconds * 1e6:.0f} | {bound} |")
    matmuls = sum(n * t for _, n, t, b in rows if b)
    print(f"\nmatrix products {matmuls * 1e3:.2f} ms, everything listed "
          f"{sum(n * t for _, n, t, _ in rows) * 1e3:.2f} ms per step\n")


def alternating(model, batch: int, new_tokens: int, rounds: int, switches: dict) -> dict:
    """Median decode-step time (s) under each setting of ``switches`` (name -> a function that turns it on), the
    settings taking turns within each round so that all of them see the same machine."""
    times = {name: [] for name in switches}
    for r in range(rounds):
        for name, switch in switches.items():
            switch()
            step_times(model, batch, 4)
            times[name] += step_times(model, batch, new_tokens, seed=r)[2:]
    return {name: statistics.median(t) for name, t in times.items()}


def split_vs_linear(preset: str, batches, new_tokens: int, rounds: int) -> None:
    """Decode steps (fp32) with ``gpt_fast.SplitLinear``'s split path and with plain ``F.linear`` (``SPLIT_ROWS`` 0),
    alternating within each round so that both see the same machine; medians over the rounds' steps."""
    model, default = build(preset, "fp32"), gpt_fast.SPLIT_ROWS
    for batch in batches:
        switches = {rows: functools.partial(setattr, gpt_fast, "SPLIT_ROWS", rows) for rows in (0, default)}
        try:
            times = alternating(model, batch, new_tokens, rounds, switches)
        finally:
            gpt_fast.SPLIT_ROWS = default
        plain, split = times[0], times[default]
        path = "split" if batch <= default else f"F.linear (more than SPLIT_ROWS = {default} rows)"
        print(f"| {preset} | {batch} | {plain * 1e3:.2f} | {split * 1e3:.2f} | {plain / split:.2f} | {path} |",
              flush=True)


def decode_step_vs_general(preset: str, dtype: str, batches, new_tokens: int, rounds: int) -> None:
    """Decode steps through ``FastGPTModel.decode_step`` and through the general ``GPTModel.forward``, alternating
    within each round; also whether the two give the same greedy tokens (they compute the same numbers)."""
    model, fast = build(preset, dtype), gpt_fast.FastGPTModel.forward
    switches = {"general": functools.partial(setattr, gpt_fast.FastGPTModel, "forward", GPTModel.forward),
                "decode_step": functools.partial(setattr, gpt_fast.FastGPTModel, "forward", fast)}
    for batch in batches:
        prompt = torch.randint(1, model.cfg.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(9))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
                times = alternating(model, batch, new_tokens, rounds, switches)
                tokens = {}
                for name, switch in switches.items():
                    switch()
                    tokens[name] = generate(model, prompt, new_tokens, model.cfg.context_length)
        finally:
            gpt_fast.FastGPTModel.forward = fast
        general, step = times["general"], times["decode_step"]
        same = torch.equal(tokens["general"], tokens["decode_step"])
        print(f"| {preset} | {dtype} | {batch} | {general * 1e3:.2f} | {step * 1e3:.2f} | {general / step:.2f} | "
              f"{'yes' if same else 'no'} |", flush=True)


def build(preset: str, dtype: str, context_length: int | None = None) -> GPTModel:
    cfg = get_preset(preset).replace(drop_rate=0.0)
    if context_length:
        cfg = cfg.replace(context_length=context_length)
    torch.manual_seed(0)
    model = speed_up(GPTModel(cfg)).eval()  # as generate.py decodes
    return model.to(DTYPES[dtype])


def print_latency(presets, tokens: int) -> None:
    """The batch-1 fp32 step at new token ``tokens`` against the step at new token 10 (context 1024 or more)."""
    print(f"| preset | weights | step at new token 10 (ms) | step at new token {tokens} (ms) | ratio |")
    print("|---|---|---|---|---|")
    for preset in presets:
        model = build(preset, "fp32", context_length=max(1024, PROMPT_LEN + tokens + 8))
        step_times(model, 1, 8)
        runs = [step_times(model, 1, tokens + 3, seed=r) for r in range(2)]
        # gap i ends at new token i + 2; take the median of five gaps around each point
        early = statistics.median(t for run in runs for t in run[6:11])
        late = statistics.median(t for run in runs for t in run[tokens - 4:tokens + 1])
        print(f"| {preset} | fp32 | {early * 1e3:.2f} | {late * 1e3:.2f} | {late / early:.2f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--presets", nargs="+", default=["demo", "gpt2-zh-small"], help="model sizes (gpt_model.PRESETS)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                   help="weights in fp32, in bf16, or in fp32 under bf16 autocast (how PPO and GRPO sample)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="rows decoded together")
    p.add_argument("--new_tokens", type=int, default=48, help="tokens per timed generation")
    p.add_argument("--rounds", type=int, default=3, help="timed generations per figure")
    p.add_argument("--latency_tokens", type=int, default=900, help="0 skips the token-10 vs token-N latency")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--ops", action="store_true",
                   help="also time each operation of a batch-1 step alone (where the step's time goes)")
    p.add_argument("--split_vs_linear", action="store_true",
                   help="only compare fp32 decode steps with gpt_fast.SplitLinear's split path and with F.linear")
    p.add_argument("--decode_step_vs_general", action="store_true",
                   help="only compare decode steps through FastGPTModel.decode_step and through GPTModel.forward")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode_step_vs_general:
        print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
        print("| preset | weights | batch | general pass (ms/step) | decode_step (ms/step) | speed-up "
              "| same greedy tokens |")
        print("|---|---|---|---|---|---|---|")
        for preset in args.presets:
            for dtype in args.dtypes:
                decode_step_vs_general(preset, dtype, args.batches, args.new_tokens, args.rounds)
        return
    if args.split_vs_linear:
        print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
        print("| preset | batch | F.linear (ms) | split (ms) | speed-up | path taken |")
        print("|---|---|---|---|---|---|")
        for preset in args.presets:
            split_vs_linear(preset, args.batches, args.new_tokens, args.rounds)
        return

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    dram = read_bandwidth(1 << 30, repeats=3)
    print(f"read bandwidth over 1 GiB (DRAM): {dram / 1e9:.1f} GB/s")
    print()
    print("| preset | weights | batch | step (ms) | bytes/step (MB) | bandwidth at that size (GB/s) | bound (ms) | "
          "step / bound |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        models = {dt: build(preset, dt) for dt in args.dtypes}
        for dt, model in models.items():
            for batch in args.batches:
                step = measure(model, batch, args.new_tokens, args.rounds, autocast=dt == "autocast")
                element = 2 if dt == "autocast" else torch.finfo(DTYPES[dt]).bits // 8
                positions = PROMPT_LEN + 2 + args.new_tokens / 2  # mean cached length over the measured steps
                weights = weight_bytes_per_step(model, batch) * element // model.tok_emb.weight.element_size()
                nbytes = weights + kv_bytes_per_step(model.cfg, batch, positions, element)
                bandwidth = read_bandwidth(int(nbytes))
                bound = nbytes / bandwidth
                print(f"| {preset} | {dt} | {batch} | {step * 1e3:.2f} | {nbytes / 1e6:.1f} | {bandwidth / 1e9:.1f} "
                      f"| {bound * 1e3:.2f} | {step / bound:.2f} |", flush=True)
        if args.ops:
            for dt in [d for d in ("fp32", "bf16") if d in models]:
                print_operation_costs(preset, dt, models[dt], read_bandwidth(int(weight_bytes_per_step(models[dt], 1))))
        if "autocast" in models:
            slow = [measure(models["autocast"], b, args.new_tokens, args.rounds, autocast=True, inference_mode=True)
                    for b in args.batches]
            print(f"\n{preset}: the autocast rows inside torch.inference_mode() (as generate ran before): "
                  + ", ".join(f"{t * 1e3:.2f} ms at batch {b}" for t, b in zip(slow, args.batches)))
        if "fp32" in models and "bf16" in models:
            agree = agreement(models["fp32"], models["bf16"], prompts=8, new_tokens=args.new_tokens)
            print(f"\n{preset}: bf16 weights vs fp32 (8 random prompts, greedy): "
                  f"{agree['tokens_before_difference']:.1f} of {agree['of']} tokens equal before the first "
                  f"difference; first-step logits max |diff| {agree['logits_max_abs_diff']:.3f} "
                  f"(largest logit {agree['logits_scale']:.2f}), top-1 agrees on {agree['top1_agree']:.0%}\n")
        del models
    if args.latency_tokens:
        print_latency(args.presets, args.latency_tokens)


if __name__ == "__main__":
    main()
