"""``lm-eval`` with our task files (``data/lm_eval/``) on a pipeline run's exported checkpoints, beside our own
figures (``plumbing/harness.py``) on the same items: the aligned checkpoint's accuracy on the held-out sentiment
problems, and the pretrained checkpoint's perplexity per byte on the held-out pretraining documents.

    python bench/lm_eval_parity.py --run_dir .            # after make pipeline, from the repository root

The figures go in bench/README.md ("lm-eval on our held-out sets").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_attention import cpu_name  # noqa: E402

from chinese_tokenizer import SEP_ID  # noqa: E402
from plumbing import harness  # noqa: E402
from plumbing.checkpoint import CHAT_STAGES, load_checkpoint  # noqa: E402
from plumbing.cli import HelpFormatter  # noqa: E402
from plumbing.hf_weights import save_hf_model  # noqa: E402


def rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def lm_eval(model_dir, task, chat, prefix=None):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = f"pretrained={model_dir},dtype=float32" + (f",prefix_token_id={prefix}" if prefix is not None else "")
    start = time.perf_counter()
    out = simple_evaluate(model="hf", model_args=args, tasks=[task],
                          task_manager=TaskManager(include_path=os.path.join(REPO_ROOT, "data", "lm_eval")),
                          apply_chat_template=chat, batch_size=8, device="cpu")
    return out["results"][task], time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--run_dir", default=".", help="a folder where make pipeline ran (its checkpoints/ and data/)")
    p.add_argument("--chat", nargs="+", default=["checkpoints/sft", "checkpoints/ppo", "checkpoints/grpo-sentiment"],
                   help="chat checkpoints to score on the sentiment problems")
    p.add_argument("--pretrained", default="checkpoints/pretrain")
    args = p.parse_args()
    run_dir = os.path.abspath(args.run_dir)
    os.chdir(run_dir)  # the task files name data/... relative to where lm-eval runs
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| checkpoint | task | lm-eval | ours | lm-eval (s) | ours (s) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, checkpoint in enumerate(args.chat):
            model, tokenizer, config = load_checkpoint(checkpoint)
            exported = os.path.join(tmp, f"chat{i}")
            save_hf_model(model.eval(), exported, tokenizer, chat=config["stage"] in CHAT_STAGES)
            theirs, seconds = lm_eval(exported, "zh_sentiment_mc", chat=True)
            start = time.perf_counter()
            accuracy, _ = harness.multiple_choice_accuracy(model, tokenizer, rows("data/sentiment/test.jsonl"),
                                                           ["正面", "负面"])
            print(f"| {checkpoint} | zh_sentiment_mc (acc) | {theirs['acc,none']:.4f} | {accuracy:.4f} | "
                  f"{seconds:.0f} | {time.perf_counter() - start:.0f} |", flush=True)

        model, tokenizer, _ = load_checkpoint(args.pretrained)
        save_hf_model(model.eval(), os.path.join(tmp, "pretrained"), tokenizer)
        theirs, seconds = lm_eval(os.path.join(tmp, "pretrained"), "zh_val_perplexity", chat=False, prefix=SEP_ID)
        start = time.perf_counter()
        documents = [r["text"] for r in rows("data/pretrain/val.jsonl")]
        perplexity, bits = harness.byte_perplexity(model, tokenizer, documents)
        print(f"| {args.pretrained} | zh_val_perplexity (per byte) | {theirs['byte_perplexity,none']:.6f} | "
              f"{perplexity:.6f} | {seconds:.0f} | {time.perf_counter() - start:.0f} |")
        print(f"| {args.pretrained} | zh_val_perplexity (bits per byte) | {theirs['bits_per_byte,none']:.6f} | "
              f"{bits:.6f} | | |")


if __name__ == "__main__":
    main()
