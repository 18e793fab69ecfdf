"""Our checkpoints in llama.cpp (``load_weight.py --to_gguf``), measured on a pipeline run's checkpoints:

1. the GGUF file's size for each ``--gguf_type``;
2. logits on the held-out pretraining text: f32's largest difference from ours (and from ours with ggml's fp16
   GELU table), f16's and q8_0's share of positions with the same top-1 token, and q8_0's if its output head were
   8-bit too (``gguf_export`` keeps it f16);
3. llama.cpp's tokenizer on the held-out texts of every stage (pretraining documents, SFT prompts and answers, the
   preference and verifiable prompts): texts whose ids differ from ours, by cause;
4. the aligned checkpoint's greedy answers to the held-out PPO prompts: llama.cpp's tokens against ours
   (``gpt_model.generate``), and its text (``gguf_export.llama_text``) against ``generate.py --temperature 0``;
5. batch-1 f32 decoding of the demo and of ``gpt2-zh-small`` (random weights) in llama.cpp (through
   llama-cpp-python, the same threads) beside our ``generate`` (``bench_decode.measure``), tokens per second.

    python bench/gguf_llama_cpp.py --run_dir .            # after make pipeline, from the repository root

The figures go in bench/README.md ("GGUF and llama.cpp").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_malloc import run_under_pipeline_malloc  # noqa: E402

run_under_pipeline_malloc()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_attention import cpu_name  # noqa: E402
from bench_decode import build, measure  # noqa: E402

from chinese_tokenizer import EOS_ID, chat_messages_ids, encode, load_tokenizer  # noqa: E402
from gpt_model import generate  # noqa: E402
from plumbing import gguf_export  # noqa: E402
from plumbing.checkpoint import load_checkpoint  # noqa: E402
from plumbing.cli import HelpFormatter  # noqa: E402
from plumbing.gguf_export import GGUF_TYPES, llama_text, save_gguf  # noqa: E402


def llama(path, n_ctx, threads, logits_all=True):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                           logits_all=logits_all, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                           verbose=False)


def rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def held_out_texts(data):
    """Every held-out text a stage reads: pretraining documents, prompts, answers, chosen and rejected replies."""
    texts = [r["text"] for r in rows(os.path.join(data, "pretrain", "val.jsonl"))]
    for name in ("sft/val.jsonl", "rm/val.jsonl", "ppo/val_prompts.jsonl", "tasks/val.jsonl", "sentiment/val.jsonl"):
        for r in rows(os.path.join(data, name)):
            texts += [v for v in r.values() if isinstance(v, str)]
            texts += [m["content"] for m in r.get("messages", []) if isinstance(m, dict)]
    return texts


def logits_table(model, tokenizer, data, tmp, threads):
    ids_all = encode("".join(r["text"] for r in rows(os.path.join(data, "pretrain", "val.jsonl"))[:40]), tokenizer)
    n = model.cfg.context_length
    chunks = [ids_all[i:i + n] for i in range(0, 8 * n, n)]
    with torch.no_grad():
        ours = [model(torch.tensor([c]))["logits"][0].numpy() for c in chunks]
        plain = [block.ff.layers[1] for block in model.trf_blocks]
        for block in model.trf_blocks:  # llama.cpp's CPU GELU: a table of fp16 values
            block.ff.layers[1] = gguf_export.GgmlGELU()
        ggml_gelu = [model(torch.tensor([c]))["logits"][0].numpy() for c in chunks]
        for block, layer in zip(model.trf_blocks, plain):
            block.ff.layers[1] = layer
    print(f"\nlogits on {sum(map(len, chunks))} positions of the held-out pretraining text "
          f"({len(chunks)} windows of {n})\n")
    print("| type | file (MB) | max abs diff | vs ours with ggml's GELU | same top-1 |")
    print("|---|---|---|---|---|")
    for gguf_type in (*GGUF_TYPES, "q8_0, 8-bit head"):
        path = os.path.join(tmp, f"m-{gguf_type}.gguf")
        if gguf_type.startswith("q8_0,"):  # what q8_0 would give with the head quantised like the rest
            keep, gguf_export._quantized = gguf_export._quantized, lambda name, a, t: keep(name.replace(
                "output.weight", "output"), a, t)
            save_gguf(model, path, tokenizer, "q8_0", chat=True)
            gguf_export._quantized = keep
        else:
            save_gguf(model, path, tokenizer, gguf_type, chat=True)
        llm = llama(path, n, threads)
        diff = diff_gelu = 0.0
        same = []
        for c, o, g in zip(chunks, ours, ggml_gelu):
            llm.reset()
            llm.eval(c)
            theirs = np.array(llm.scores[:len(c)])
            diff, diff_gelu = max(diff, np.abs(theirs - o).max()), max(diff_gelu, np.abs(theirs - g).max())
            same.append(theirs.argmax(-1) == o.argmax(-1))
        llm.close()
        print(f"| {gguf_type} | {os.path.getsize(path) / 1e6:.1f} | {diff:.2e} | {diff_gelu:.2e} | "
              f"{np.concatenate(same).mean():.2%} |", flush=True)
    return os.path.join(tmp, "m-f32.gguf")


def tokenizer_table(path, tokenizer, data, threads):
    llm = llama(path, 256, threads, logits_all=False)
    texts = held_out_texts(data)
    hangul = other = 0
    examples = []
    for text in texts:
        if llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) != encode(text, tokenizer):
            if any(0xAC00 <= ord(c) <= 0xD7A3 for c in text):
                hangul += 1
            else:
                other += 1
                examples.append(text[:80])
    llm.close()
    print(f"\ntokenizer: {len(texts)} held-out texts, {len(texts) - hangul - other} with our ids; "
          f"{hangul} differ with Korean in them, {other} otherwise{': ' + repr(examples[:3]) if examples else ''}")


def greedy_table(path, model, tokenizer, checkpoint, data, threads, max_new_tokens):
    prompts = [r["prompt"] for r in rows(os.path.join(data, "ppo", "val_prompts.jsonl"))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "answers.jsonl")
        subprocess.run([sys.executable, "generate.py", "--checkpoint", checkpoint, "--prompts_file",
                        os.path.join(data, "ppo", "val_prompts.jsonl"), "--temperature", "0", "--max_new_tokens",
                        str(max_new_tokens), "--output", out], check=True, capture_output=True, cwd=REPO_ROOT)
        texts = [r["response"] for r in rows(out)]
    llm = llama(path, model.cfg.context_length, threads)
    same_ids = same_text = 0
    for prompt, text in zip(prompts, texts):
        ids = chat_messages_ids([("user", prompt)], tokenizer)
        llm.reset()
        llm.eval(ids)
        answer = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # the last position's logits
            if token == EOS_ID:
                break
            answer.append(token)
            llm.eval([token])
        ours = generate(model, torch.tensor([ids]), max_new_tokens, model.cfg.context_length, temperature=0.0,
                        eos_id=EOS_ID)[0, len(ids):].tolist()
        same_ids += answer == [t for t in ours if t != EOS_ID]
        same_text += llama_text(llm, answer) == text
    llm.close()
    print(f"\ngreedy answers to {len(prompts)} held-out PPO prompts ({max_new_tokens} tokens at most): "
          f"{same_ids} with our tokens, {same_text} with generate.py's text")


def decode_table(tokenizer, tmp, threads, new_tokens, rounds):
    print(f"\nbatch-1 f32 decoding, {threads} threads: median step over {rounds} x {new_tokens} new tokens\n")
    print("| preset | ours (ms/token) | llama.cpp (ms/token) | ours (tokens/s) | llama.cpp (tokens/s) |")
    print("|---|---|---|---|---|")
    sizes = []
    for preset in ("demo", "gpt2-zh-small"):
        model = build(preset, "fp32")
        ours = measure(model, 1, new_tokens, rounds)
        path = os.path.join(tmp, f"{preset}.gguf")
        save_gguf(model, path, tokenizer, "f32")
        llm = llama(path, model.cfg.context_length, threads, logits_all=False)
        steps = []
        for r in range(rounds + 1):
            llm.reset()
            llm.eval(list(range(1000 + r, 1008 + r)))  # the bench's prompt length (bench_decode.PROMPT_LEN)
            for t in range(new_tokens):
                start = time.perf_counter()
                llm.eval([2000 + t])
                if r:  # round 0 warms up
                    steps.append(time.perf_counter() - start)
        llm.close()
        theirs = statistics.median(steps[2:])
        print(f"| {preset} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {1 / ours:.0f} | {1 / theirs:.0f} |", flush=True)
        files = {"f32": path}
        for gguf_type in GGUF_TYPES[1:]:
            files[gguf_type] = os.path.join(tmp, f"{preset}-{gguf_type}.gguf")
            save_gguf(model, files[gguf_type], tokenizer, gguf_type)
        sizes.append(f"{preset} " + ", ".join(f"{t} {os.path.getsize(f) / 1e6:.1f} MB" for t, f in files.items()))
    print("\nGGUF files: " + "; ".join(sizes))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--run_dir", default=".", help="a folder where make pipeline ran (its checkpoints/ and data/)")
    p.add_argument("--checkpoint", default="checkpoints/ppo", help="the aligned checkpoint, under --run_dir")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--new_tokens", type=int, default=48, help="tokens per timed generation")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, llama-cpp-python {llama_cpp.__version__}, "
          f"{args.threads} threads")
    checkpoint = os.path.abspath(os.path.join(args.run_dir, args.checkpoint))
    data = os.path.abspath(os.path.join(args.run_dir, "data"))
    model, tokenizer, _ = load_checkpoint(checkpoint)
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = logits_table(model, tokenizer, data, tmp, args.threads)
        tokenizer_table(path, tokenizer, data, args.threads)
        greedy_table(path, model, tokenizer, checkpoint, data, args.threads, args.max_new_tokens)
        decode_table(load_tokenizer(os.path.join(checkpoint, "tokenizer")), tmp, args.threads, args.new_tokens,
                     args.rounds)


if __name__ == "__main__":
    main()
