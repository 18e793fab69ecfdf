"""Pretraining data at a size that does not fit the old in-memory path: a synthetic corpus of real documents.

It builds a corpus of at least ``--size_gb`` GB of JSON lines from ``data/pretrain/train.jsonl`` (the documents
repeated, each copy in a new shuffled order, split over several files), then measures in one run:

  tokenize   text MB/s on the first ``--sample_mb`` MB: the stages' own path (``token_cache.tokenize_to_file``) on one
             thread and with the fast tokenizer's own threads (what the stages do), and ``datasets.map`` with 2
             processes for comparison
  first run  ``0-PRETRAIN.py --max_steps 20`` on the whole corpus from a cold cache: wall time and peak resident
             memory (the largest of the run's processes)
  second run the same command again: the tokens come from the cache; wall time, the time until the first training
             step is logged, and peak resident memory
  demo       the same 20-step run on the demo corpus, for the memory ratio

    python bench/bench_data.py                     # 1 GB in /tmp/bench_corpus (about 10 minutes on 2 cores)
    python bench/bench_data.py --size_gb 0.2       # a quicker look

The figures go in bench/README.md ("Pretraining data larger than memory").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Run a command as a child of a small Python process and print the largest resident set of its descendants (KiB),
# so the figure covers the stage and any tokenizing workers it forks.
MEASURE = ("import resource, subprocess, sys, time\n"
           "t = time.time(); code = subprocess.run(sys.argv[1:]).returncode\n"
           "print(f'BENCH rc={code} wall={time.time() - t:.2f} '\n"
           "      f'maxrss_kib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', flush=True)\n")


def build_corpus(out: str, size_gb: float, files: int, seed: int = 0) -> tuple[list[str], int]:
    """Write ``files`` .jsonl files holding at least ``size_gb`` GB of documents; returns (paths, bytes)."""
    with open(os.path.join(ROOT, "data", "pretrain", "train.jsonl"), encoding="utf-8") as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    per_copy = sum(len(line.encode("utf-8")) for line in lines)
    copies = max(1, int(size_gb * 1e9 // per_copy) + 1)
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"part-{i:02d}.jsonl") for i in range(files)]
    rng = random.Random(seed)
    handles = [open(p, "w", encoding="utf-8") for p in paths]
    for copy in range(copies):
        order = lines[:]
        rng.shuffle(order)
        handles[copy % files].writelines(order)
    for h in handles:
        h.close()
    return paths, sum(os.path.getsize(p) for p in paths)


def sample_file(paths: list[str], sample_mb: int, out: str) -> tuple[str, int]:
    """The first ``sample_mb`` MB of the corpus's first file, as its own .jsonl; returns (path, bytes)."""
    size = 0
    with open(paths[0], encoding="utf-8") as f, open(out, "w", encoding="utf-8") as g:
        for line in f:
            g.write(line)
            size += len(line.encode("utf-8"))
            if size >= sample_mb * 1e6:
                break
    return out, size


def tokenize_rate(sample: str, size: int, num_proc: int, threads: bool = True) -> float:
    """Text MB/s of tokenizing ``sample`` with the project tokenizer. One process: the stages' own path,
    ``token_cache.tokenize_to_file`` (read, tokenize and write the token file); 2 processes: ``datasets.map`` with
    ``num_proc=2`` on the same texts (tokenizing only), for comparison. ``threads=False`` turns off the fast
    tokenizer's own threads (TOKENIZERS_PARALLELISM)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    from chinese_tokenizer import load_tokenizer
    from plumbing.documents import load_text_documents
    from plumbing.token_cache import description_path, tokenize_to_file

    tokenizer = load_tokenizer(os.path.join(ROOT, "data", "tokenizer"))
    if num_proc == 1:
        target = sample + ".bin"
        t = time.time()
        tokenize_to_file(load_text_documents(sample, "sample"), tokenizer, target, None, "sample")
        seconds = time.time() - t
        os.remove(target)
        os.remove(description_path(target))
        return size / 1e6 / seconds

    import datasets

    with open(sample, encoding="utf-8") as f:
        ds = datasets.Dataset.from_dict({"text": [json.loads(line)["text"] for line in f]})

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}

    t = time.time()
    ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"],
           load_from_cache_file=False, keep_in_memory=True, desc=f"tokenize x{num_proc}")
    return size / 1e6 / (time.time() - t)


def pretrain_run(train_files: list[str], out: str, label: str, env: dict) -> dict:
    """``0-PRETRAIN.py --max_steps 20`` under MEASURE; returns wall, peak memory and the first step's time."""
    command = [sys.executable, "-c", MEASURE, sys.executable, os.path.join(ROOT, "0-PRETRAIN.py"), "--max_steps",
               "20", "--eval_every", "20", "--eval_examples", "8", "--train_files", *train_files, "--val_files",
               os.path.join(ROOT, "data", "pretrain", "val.jsonl"), "--output_dir", out, "--overwrite"]
    t0 = time.time()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            bufsize=1)
    first_step, tail = None, []
    buffer = ""
    while True:
        piece = proc.stdout.read(256)
        if not piece:
            break
        buffer += piece
        if first_step is None and re.search(r"pretrain:\s+\d+%\|[^|]*\| [1-9]\d*/20", buffer):
            first_step = time.time() - t0
        buffer = buffer[-4096:]
        tail.append(piece)
    proc.wait()
    text = "".join(tail)
    found = re.search(r"BENCH rc=(\d+) wall=([\d.]+) maxrss_kib=(\d+)", text)
    if not found or found.group(1) != "0":
        print(text[-3000:])
        raise SystemExit(f"bench_data: the {label} run failed")
    return {"wall_s": float(found.group(2)), "first_step_s": first_step, "peak_rss_mb": int(found.group(3)) / 1024}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/bench_corpus", help="where the synthetic corpus and the runs go")
    p.add_argument("--size_gb", type=float, default=1.0)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--sample_mb", type=int, default=64, help="text tokenized for the MB/s figures")
    p.add_argument("--keep", action="store_true", help="keep the corpus and its token cache afterwards")
    args = p.parse_args()

    import datasets
    import torch
    from bench_attention import cpu_name
    from pipeline_malloc import MALLOC

    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores; torch {torch.__version__}, datasets {datasets.__version__}")
    cache = os.path.join(args.out, "hf_cache")  # a datasets cache of its own: the first run is really cold
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_CACHE": cache,
           "GLIBC_TUNABLES": MALLOC}
    t = time.time()
    paths, size = build_corpus(os.path.join(args.out, "corpus"), args.size_gb, args.files)
    print(f"corpus: {size / 1e9:.2f} GB in {len(paths)} files ({time.time() - t:.0f} s to write)")

    sample, sample_bytes = sample_file(paths, args.sample_mb, os.path.join(args.out, "sample.jsonl"))
    single = tokenize_rate(sample, sample_bytes, 1, threads=False)
    threaded = tokenize_rate(sample, sample_bytes, 1)
    two = tokenize_rate(sample, sample_bytes, 2, threads=False)
    os.environ.pop("TOKENIZERS_PARALLELISM")
    print(f"tokenize {sample_bytes / 1e6:.0f} MB: the stages' path on 1 thread {single:.2f} MB/s; with the "
          f"tokenizer's own threads (what the stages do) {threaded:.2f} MB/s ({threaded / single:.2f}x); "
          f"datasets.map with 2 processes {two:.2f} MB/s ({two / single:.2f}x)")

    first = pretrain_run(paths, os.path.join(args.out, "run1"), "first", env)
    second = pretrain_run(paths, os.path.join(args.out, "run2"), "second", env)
    demo = pretrain_run([os.path.join(ROOT, "data", "pretrain", "train.jsonl")], os.path.join(args.out, "run_demo"),
                        "demo", env)
    print("| run | wall (s) | first step logged at (s) | peak resident memory (MB) |")
    print("|---|---|---|---|")
    big = f"{size / 1e9:.2f} GB corpus"
    for name, r in ((f"{big}, cold cache", first), (f"{big}, second run", second),
                    ("demo corpus (warm cache)", demo)):
        step = f"{r['first_step_s']:.1f}" if r["first_step_s"] is not None else "—"
        print(f"| {name} | {r['wall_s']:.1f} | {step} | {r['peak_rss_mb']:.0f} |")
    cold, warm = (r["peak_rss_mb"] / demo["peak_rss_mb"] for r in (first, second))
    print(f"peak memory on the big corpus / on the demo corpus: cold run {cold:.2f}, second run {warm:.2f}")
    if not args.keep:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
