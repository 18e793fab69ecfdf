"""Attention forward + backward on the CPU under bf16 autocast: PyTorch's fused kernel fed bf16, the same kernel fed
fp32 (what ``gpt_fast.fused_attention`` does on the CPU) and the written-out ``attention_reference``.

The demo's stages train under bf16 autocast on CPUs that compute bf16 natively. This measures, in one run and at
the demo's shapes (pretraining's 16 x 128 causal blocks; the RM's 32 padded pairs of about 72 tokens), why the
fused kernel gets fp32 inputs there. A benchmark, not a test: nothing fails on a slow figure.

    .venv/bin/python bench/bench_attention.py            # about 20 s
    .venv/bin/python bench/bench_attention.py --repeats 30
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt_fast import fused_attention
from gpt_model import attention_reference, causal_mask


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def masks(batch: int, length: int, padded: bool):
    """(visible, is_causal): a plain causal pass, or a causal mask where every other row has 22 padding keys."""
    if not padded:
        return None, True
    visible = causal_mask(length, length)[None, None].repeat(batch, 1, 1, 1)  # (B, 1, T, T)
    visible[::2, :, :, length - 22:] = False
    visible |= torch.eye(length, dtype=torch.bool)  # a padding query still sees itself: no empty row
    return visible, False


def time_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15, help="timed calls per variant (the median is shown)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("forward + backward of one attention layer in ms (median of "
          f"{args.repeats}), q/k/v of {args.heads} heads x {args.head_dim} from a bf16 autocast projection")
    print(f"{'shape':<26}{'fused, bf16 in':>16}{'fused, fp32 in':>16}{'written out':>14}{'fp32 / bf16':>13}")
    for name, batch, length, padded in (("pretrain 16 x 128 causal", 16, 128, False),
                                        ("RM 32 x 72 padded", 32, 72, True),
                                        ("SFT 16 x 128 padded", 16, 128, True)):
        visible, causal = masks(batch, length, padded)
        qkv = [torch.randn(batch, args.heads, length, args.head_dim, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]

        def bf16_kernel():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = F.scaled_dot_product_attention(*qkv, attn_mask=visible, is_causal=causal)
            out.float().sum().backward()

        def fp32_kernel():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fused_attention(*qkv, visible, causal)
            out.float().sum().backward()

        def written_out():
            mask = causal_mask(length, length) if causal else visible
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attention_reference(*qkv, mask)
            out.float().sum().backward()

        row = [time_ms(f, args.repeats) for f in (bf16_kernel, fp32_kernel, written_out)]
        print(f"{name:<26}{row[0]:>16.2f}{row[1]:>16.2f}{row[2]:>14.2f}{row[1] / row[0]:>13.2f}")


if __name__ == "__main__":
    main()
