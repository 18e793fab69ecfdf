"""What this machine computes fast: the precision the stages train in and the device commands generate on.

* ``native_bf16``: whether bf16 matrix products run natively here (a GPU with bf16, a CPU with AVX512-BF16 or AMX);
  elsewhere bf16 is emulated and many times slower than float32, so nothing should choose it by default.
* ``pick_mixed_precision``: the ``--mixed_precision`` a stage runs with ("auto" follows ``accelerate launch``, else
  bf16 exactly where it is native).
* ``pick_device``: ``--device`` of generate.py and serve.py (cuda when there is a GPU, else cpu).
* ``forked_rng``: a block whose random draws leave the RNGs of the CPU and of the device as they were.
"""

from __future__ import annotations

import os

import torch

from plumbing.cli import UserError


def native_bf16() -> bool:
    """True where bf16 matmuls run natively: a CUDA GPU that supports bf16, or a CPU whose flags include
    AVX512-BF16 or AMX-BF16 (Linux ``/proc/cpuinfo``; elsewhere False). Without them bf16 is emulated and slower."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_mixed_precision(choice: str) -> str:
    """``--mixed_precision``: an explicit "no"/"bf16"/"fp16" wins. "auto" keeps what ``accelerate launch`` was
    given (it always sets ``ACCELERATE_MIXED_PRECISION``, from its flag or its config); a stage run with plain
    ``python`` gets bf16 where ``native_bf16()``, else "no" (fp32)."""
    if choice != "auto":
        return choice
    return os.environ.get("ACCELERATE_MIXED_PRECISION") or ("bf16" if native_bf16() else "no")


def forked_rng(device):
    """``torch.random.fork_rng`` over the CPU's generator and, on a GPU, that device's own: sampling inside
    (held-out answers, sample texts) must not move the RNG that training draws from, or a ``--resume`` would not
    repeat the run. ``fork_rng(devices=[])`` alone forks the CPU's generator only, and on a GPU dropout and
    sampling draw from the device's."""
    device = torch.device(device)
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def pick_device(name: str | None) -> torch.device:
    """``--device``, or cuda when there is a GPU, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is available here; use --device cpu or leave it out")
    return device
