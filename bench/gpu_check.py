"""The device check: everything this project needs a GPU to prove, in one command and one Markdown table.

    python bench/gpu_check.py                  # on a machine with a CUDA GPU (under 8 minutes on one H200)
    python bench/gpu_check.py --dry_run        # the same steps at tiny size, on the CPU (tests/test_gpu_check.py)

In order, each step timed, a failing step recorded in the table instead of stopping the others:
  1. the machine: GPU, its dense bf16 peak (``plumbing/flops.py``), versions; the device's read bandwidth and the
     rate of a large bf16 matrix product, measured (the ceilings the figures below are read against);
  2. pretraining ``gpt2-zh-small`` in bf16: the largest micro-batch of a ladder that fits, where one step's time
     goes (``step_breakdown``), then ``0-PRETRAIN.py`` as
     a user runs it (``accelerate launch --mixed_precision bf16``), with ``--compile`` off and on: tokens/s, FLOP/s
     and MFU (6N + 12·L·H·Q·T per token, the median over the steps after the first five), compile seconds;
  3. decoding at batch 1 and 64 (bf16 and fp32 weights) against the memory-bandwidth bound;
  4. the demo pipeline (``python pipeline.py``, as ``make pipeline`` runs it) and its wall time, in a copy of the
     code (``isolated_checkout``) so that no checkpoint of the user's is touched, started in the background while
  5. the CUDA tests (``pytest -m cuda tests/test_cuda.py``) run; they measure no speed, the pipeline's wall time
     is measured with them beside it.

Writes ``--out`` (default ``reports/gpu_check/``): ``table.md`` (the table, also printed), ``results.json``,
``log.txt`` (the tail of every command's output) and the pipeline's ``report.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import kv_bytes_per_step, weight_bytes_per_step  # noqa: E402 (the repository on the path first)

from gpt_fast import chunked_next_token_loss, generate, speed_up  # noqa: E402
from gpt_model import GPTModel, get_preset  # noqa: E402
from plumbing.flops import device_name, format_utilisation, peak_flops, training_flops_per_token, utilisation  # noqa: E402
from plumbing.optimizers import make_optimizer  # noqa: E402

# The sizes of a real check and of the dry run (the same steps, small enough for 2 CPU cores).
SIZES = {
    "gpu": dict(preset="gpt2-zh-small", ladder=(64, 128, 256, 512, 1024), steps=30, skip=5, pipeline="demo",
                decode_presets=("demo", "gpt2-zh-small"), decode_batches=(1, 64), matmul=8192, buffer=2 << 30),
    "dry": dict(preset="tiny", ladder=(2, 4), steps=8, skip=2, pipeline="tiny", decode_presets=("tiny",),
                decode_batches=(1, 4), matmul=512, buffer=64 << 20),
}
SECTIONS = ("pretrain", "decode", "pipeline", "tests")
CODE = ("0-PRETRAIN.py", "1-SFT.py", "2-RM.py", "3-PPO.py", "3-DPO.py", "3-GRPO.py", "pipeline.py", "generate.py",
        "load_weight.py", "chinese_tokenizer.py", "gpt_model.py", "gpt_fast.py", "lora.py", "plumbing")


class Check:
    """The table being built, the log, and the time left."""

    def __init__(self, out: str, budget_s: float):
        self.out, self.deadline, self.started = out, time.time() + budget_s, time.time()
        self.rows, self.results, self.tests_filter = [], {}, None
        os.makedirs(out, exist_ok=True)
        self.log_path = os.path.join(out, "log.txt")
        open(self.log_path, "w").close()

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, title: str, text: str) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"\n===== {title} =====\n{text[-6000:]}\n")

    def step(self, name: str, fn, *args):
        """Run one step; its rows go in the table, an exception becomes a row that says so."""
        started = time.time()
        try:
            rows = fn(*args)
        except Exception as e:  # noqa: BLE001 (a failing step is a result to report, the rest still runs)
            rows = [(name, f"**failed**: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")]
            self.log(f"{name} failed", repr(e))
        for i, (what, result) in enumerate(rows):
            self.rows.append((what, result, f"{time.time() - started:.0f}" if i == len(rows) - 1 else ""))
        self.write()

    def write(self) -> None:
        lines = ["| check | result | seconds |", "|---|---|---|"]
        lines += [f"| {w} | {r} | {s} |" for w, r, s in self.rows]
        table = "\n".join(lines) + "\n"
        with open(os.path.join(self.out, "table.md"), "w", encoding="utf-8") as f:
            f.write(table)
        with open(os.path.join(self.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(self.results, f, indent=1)


def last_line(output: str) -> str:
    """The last non-empty line of a command's output (what it said last, usually its error), or "no output"."""
    lines = output.strip().splitlines()
    return lines[-1][:300] if lines else "no output"


def run(command: list[str], check: Check, title: str, timeout: float, cwd: str = ROOT, env: dict | None = None):
    """Run a command with a time limit; its output's tail goes to the log. Returns (exit code or None, output)."""
    if timeout < 1:
        check.log(f"{title} (not started)", "no time left in --budget_s")
        return None, ""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    check.log(f"{title} (exit {code})", output)
    return code, output


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device, repeats: int) -> float:
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times)


# --- 1. the machine ------------------------------------------------------------------------------------------------

def machine(check: Check, device, size) -> list:
    import accelerate
    import transformers

    peak = peak_flops(device)
    name = device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    buffer = torch.ones(size["buffer"] // 2, dtype=torch.bfloat16, device=device)
    read = buffer.numel() * 2 / best_time(lambda x=buffer: x.sum(), device, 5)
    del buffer
    n = size["matmul"]
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    matmul = 2 * n ** 3 / best_time(lambda x=a, y=b: x @ y, device, 10)
    del a, b
    check.results["machine"] = {"device": name, "peak_flops": peak, "read_bandwidth": read, "bf16_matmul": matmul,
                                "torch": torch.__version__, "transformers": transformers.__version__,
                                "accelerate": accelerate.__version__}
    peak_text = f"dense bf16 peak {peak / 1e12:.0f} TFLOP/s (datasheet)" if peak else "no known bf16 peak"
    return [("device", f"{name}; {peak_text}; torch {torch.__version__}, transformers {transformers.__version__}, "
                       f"accelerate {accelerate.__version__}"),
            ("ceilings, measured", f"read bandwidth {read / 1e9:.0f} GB/s (`sum` over {size['buffer'] >> 20} MiB); "
                                   f"bf16 {n}³ matrix product {matmul / 1e12:.1f} TFLOP/s")]


# --- 2. pretraining throughput ---------------------------------------------------------------------------------------

def largest_batch(check: Check, device, size) -> list:
    """The largest micro-batch of the ladder whose training step (bf16 autocast, fused AdamW) fits in memory."""
    cfg = get_preset(size["preset"])
    model = speed_up(GPTModel(cfg)).to(device)
    optimizer = make_optimizer(model, 1e-4, 0.1, "adamw")
    fits, memory = None, {}
    for batch in size["ladder"]:
        try:
            ids = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length), device=device)
            for _ in range(2):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(ids, labels=ids)["loss"]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            fits = batch
            if device.type == "cuda":
                memory[batch] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        except torch.OutOfMemoryError:
            break
        finally:
            loss = ids = None  # noqa: F841 (free before the next size)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if fits is None:
        raise RuntimeError(f"not even a micro-batch of {size['ladder'][0]} fits")
    check.results["micro_batch"] = {"largest": fits, "ladder": size["ladder"], "peak_gib": memory}
    used = f", peak memory {memory[fits]:.1f} GiB" if fits in memory else ""
    return [(f"micro-batch, {size['preset']}", f"largest of {list(size['ladder'])} that trains: {fits} x "
                                               f"{cfg.context_length} tokens{used}")]


def pretrain_throughput(check: Check, device, size, compiled: bool) -> list:
    """``0-PRETRAIN.py`` under ``accelerate launch --mixed_precision bf16`` for ``steps`` steps (``--stop_after``:
    no evaluation), then the median FLOP/s and MFU of its log rows after the first ``skip`` steps."""
    cfg = get_preset(size["preset"])
    batch = check.results["micro_batch"]["largest"]
    out = tempfile.mkdtemp(prefix="gpu_check_pretrain_")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "bf16", "--dynamo_backend", "no", "0-PRETRAIN.py", "--preset", size["preset"],
               "--batch_size", str(batch), "--max_steps", "1000", "--warmup_steps", "10",
               "--stop_after", str(size["steps"]), "--output_dir", out]
    if compiled:
        command.append("--compile")
    if device.type == "cpu":
        command[3:3] = ["--cpu"]
    started = time.time()
    code, output = run(command, check, f"pretrain compile={compiled}", check.left() - 30)
    wall = time.time() - started
    try:
        if code is None:
            raise TimeoutError(f"cut short: the --budget_s left too little time ({last_line(output)})")
        if code != 0:
            raise RuntimeError(f"0-PRETRAIN.py exited {code}: {last_line(output)}")
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steady = [r for r in rows if r["step"] > size["skip"] and "flop_s" in r and "val_loss" not in r]  # training alone
    flop_s = statistics.median(r["flop_s"] for r in steady)
    per_token = training_flops_per_token(cfg, cfg.context_length)
    tokens_s = flop_s / per_token
    first = rows[0]["time_s"]  # the first step's wall time: start-up of the loop, compilation included
    step_s = batch * cfg.context_length / tokens_s
    peak = peak_flops(device)
    result = {"batch": batch, "tokens_per_s": tokens_s, "flop_s": flop_s, "mfu": flop_s / peak if peak else None,
              "first_step_s": first, "step_s": step_s, "stage_wall_s": wall}
    check.results[f"pretrain_compile_{compiled}"] = result
    values = utilisation(flop_s, peak)
    return [(f"pretrain {size['preset']}, bf16, {'--compile' if compiled else 'eager'}",
             f"micro-batch {batch}: {tokens_s:,.0f} tokens/s, {format_utilisation(values)}; step {step_s:.3f} s; "
             f"first step {first:.1f} s (compilation included); whole run {wall:.0f} s for {size['steps']} steps")]


def step_breakdown(check: Check, device, size) -> list:
    """Where one training step's time goes, at the largest micro-batch, timed in this process (median of 3 after a
    warm-up): the forward pass through the blocks, the head with the loss (``chunked_next_token_loss`` also makes
    the head's gradients), the backward pass, and clipping + the fused AdamW step. Their sum against the stage's
    own step time leaves what the loop adds around them (the batch, the synchronisations, the log)."""
    cfg = get_preset(size["preset"])
    batch = check.results["micro_batch"]["largest"]
    model = speed_up(GPTModel(cfg)).to(device).train()
    optimizer = make_optimizer(model, 1e-4, 0.1, "adamw")
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length), device=device)
    parts = {"blocks forward": [], "head + loss (and its gradients)": [], "backward": [], "clip + AdamW": []}
    for _ in range(4):
        marks = []

        def mark():
            synchronize(device)
            marks.append(time.perf_counter())

        mark()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hidden, _ = model.hidden_states(ids)
            mark()
            loss = chunked_next_token_loss(hidden, model.out_head.weight, ids)
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark()
        for key, a, b in zip(parts, marks, marks[1:]):
            parts[key].append(b - a)
    del model, optimizer, ids, hidden, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times = {k: statistics.median(v[1:]) for k, v in parts.items()}
    check.results["step_breakdown"] = {"batch": batch, **times}
    total = sum(times.values())
    text = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in times.items())
    return [(f"one eager step of {size['preset']}, micro-batch {batch}", f"{text}; sum {total * 1e3:.0f} ms")]


# --- 3. the CUDA tests -----------------------------------------------------------------------------------------------

def cuda_tests(check: Check, device, size) -> list:
    chosen = ["-k", check.tests_filter] if check.tests_filter else []
    code, output = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
                        *chosen, "tests/test_cuda.py"], check, "pytest -m cuda", check.left() - 20)
    summary = next((line.strip("= ") for line in reversed(output.splitlines()) if " in " in line and (
        "passed" in line or "failed" in line or "skipped" in line or "error" in line)),
        "cut short: the --budget_s left too little time" if code is None else f"no summary (exit {code})")
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    check.results["cuda_tests"] = {"exit": code, "summary": summary, "failed": failed}
    return [(f"CUDA tests (`pytest -m cuda{' -k ' + repr(check.tests_filter) if chosen else ''} tests/test_cuda.py`)",
             summary + ("; " + "; ".join(f[:150] for f in failed) if failed else ""))]


# --- 4. decoding ---------------------------------------------------------------------------------------------------

def decode(check: Check, device, size) -> list:
    """Seconds per new token of greedy ``generate`` (the difference of a 24- and a 88-token run, so the prompt's pass
    drops out), against (weights + cached keys/values read per step) / the measured read bandwidth."""
    read = check.results["machine"]["read_bandwidth"]
    rows = []
    for preset in size["decode_presets"]:
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            model = speed_up(GPTModel(get_preset(preset).replace(drop_rate=0.0))).to(device, dtype).eval()
            for batch in size["decode_batches"] if dtype == torch.bfloat16 else size["decode_batches"][:1]:
                prompt = torch.randint(1, model.cfg.vocab_size, (batch, 16), device=device)
                short, long_ = 24, min(88, model.cfg.context_length - 16)
                t_short = best_time(lambda m=model, x=prompt: generate(m, x, short, m.cfg.context_length), device, 3)
                t_long = best_time(lambda m=model, x=prompt: generate(m, x, long_, m.cfg.context_length), device, 3)
                step = (t_long - t_short) / (long_ - short)
                element = torch.finfo(dtype).bits // 8
                nbytes = weight_bytes_per_step(model, batch) + kv_bytes_per_step(
                    model.cfg, batch, 16 + (short + long_) / 2, element)
                bound = nbytes / read
                name = "bf16" if dtype == torch.bfloat16 else "fp32"
                check.results[f"decode_{preset}_{name}_{batch}"] = {"step_s": step, "bound_s": bound,
                                                                   "bytes": nbytes}
                rows.append((f"decode {preset}, {name} weights, batch {batch}",
                             f"{step * 1e3:.3f} ms/step = {batch / step:,.0f} tokens/s; bound {bound * 1e3:.3f} ms "
                             f"({nbytes / 1e6:.0f} MB at {read / 1e9:.0f} GB/s); step / bound {step / bound:.1f}"))
            del model
    return rows


# --- 5. the demo pipeline -------------------------------------------------------------------------------------------

def isolated_checkout(dest: str) -> str:
    """A copy of the code in ``dest`` whose ``data`` is a link to this checkout's, so that ``pipeline.py`` (which
    writes its checkpoints beside itself) runs without touching this checkout's checkpoints/ or reports/."""
    os.makedirs(dest, exist_ok=True)
    for name in CODE:
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(dest, name), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest)
    os.symlink(os.path.join(ROOT, "data"), os.path.join(dest, "data"))
    return dest


class Pipeline:
    """``python pipeline.py --preset P`` in an ``isolated_checkout``, started in the background (``start``) so that
    the CUDA tests, which measure no speed, run beside it; ``finish`` waits for it within the time left."""

    def __init__(self, check: Check, size):
        self.check, self.preset = check, size["pipeline"]
        self.work = tempfile.mkdtemp(prefix="gpu_check_pipeline_")
        self.code_dir = isolated_checkout(os.path.join(self.work, "repo"))
        self.log = open(os.path.join(self.work, "pipeline.log"), "w+", encoding="utf-8")
        self.started = time.time()
        self.process = subprocess.Popen([sys.executable, "pipeline.py", "--preset", self.preset], cwd=self.code_dir,
                                        stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def finish(self) -> list:
        try:
            code = self.process.wait(timeout=max(self.check.left(), 1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = None
        wall = time.time() - self.started
        self.log.seek(0)
        output = self.log.read()
        self.check.log(f"pipeline (exit {code})", output)
        report = os.path.join(self.code_dir, "reports", "report.md")
        if os.path.isfile(report):
            shutil.copy2(report, os.path.join(self.check.out, "report.md"))
        stages = [line.split("===")[1].strip() for line in output.splitlines() if line.startswith("=== [")]
        shutil.rmtree(self.work, ignore_errors=True)
        self.check.results["pipeline"] = {"exit": code, "wall_s": wall, "stages_started": stages}
        what = f"`python pipeline.py --preset {self.preset}` (the CUDA tests ran beside it)"
        if code is None:
            return [(what, f"**cut short**: not finished after {wall:.0f} s, when --budget_s ran out; last step "
                           f"started: {stages[-1] if stages else 'none'}")]
        if code != 0:
            return [(what, f"**failed** (exit {code}) after {wall:.0f} s: {last_line(output)}")]
        return [(what, f"finished in {wall:.0f} s ({wall / 60:.1f} min); its report card is report.md")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry_run", action="store_true", help="the same steps at tiny size, on the CPU")
    p.add_argument("--out", default=os.path.join(ROOT, "reports", "gpu_check"), help="folder for the results")
    p.add_argument("--budget_s", type=float, default=530.0,
                   help="seconds the whole check may take; a step that would run past it is cut short and says so")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS),
                   help="run only these steps (the device row always runs)")
    p.add_argument("--tests_filter", help="pytest -k expression for the CUDA tests (default: all of them)")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error(f"--budget_s must be a positive number of seconds, got {args.budget_s}")
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --dry_run to try the steps on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    size = SIZES["dry" if args.dry_run else "gpu"]
    check = Check(args.out, args.budget_s)
    check.tests_filter = args.tests_filter
    check.step("device", machine, check, device, size)
    if "pretrain" in args.sections:
        check.step("micro-batch", largest_batch, check, device, size)
        check.step("step breakdown", step_breakdown, check, device, size)
        for compiled in (False, True):
            check.step(f"pretrain compile={compiled}", pretrain_throughput, check, device, size, compiled)
    if "decode" in args.sections:
        check.step("decode", decode, check, device, size)
    background = None
    if "pipeline" in args.sections:
        if not os.path.isfile(os.path.join(ROOT, "data", "MANIFEST.json")):
            check.rows.append(("pipeline", "**not run**: data/ is not built (python data/prepare.py)", ""))
        else:
            background = Pipeline(check, size)
    if "tests" in args.sections:
        check.step("CUDA tests", cuda_tests, check, device, size)
    if background is not None:
        check.step("pipeline", background.finish)
    check.rows.append(("whole check", "", f"{time.time() - check.started:.0f}"))
    check.write()
    with open(os.path.join(args.out, "table.md"), encoding="utf-8") as f:
        print(f.read())
    # a step that failed or was cut short makes the check fail too (the table says which)
    return 1 if any("**" in result or "cut short" in result for _, result, _ in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
