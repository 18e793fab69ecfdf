"""Stage 0 — pretraining: teach a GPT-2 to continue Chinese text by predicting each next token.

Story of the stage: arguments → data (documents tokenized and packed into blocks) → model (new, or from a
checkpoint / public GPT-2 weights) → the loop (the preset's optimizer: AdamW, or for the demo Muon on the blocks'
matrices with AdamW on the rest; warm-up + cosine, gradient accumulation and clipping through Accelerate; eval loss,
perplexity and two sample continuations every ``--eval_every`` steps) → checkpoint.

    python 0-PRETRAIN.py                      # demo preset on data/pretrain/, writes checkpoints/pretrain/
    accelerate launch 0-PRETRAIN.py --preset gpt2-zh-small --mixed_precision bf16 ...
"""

from __future__ import annotations

import math
import os

import torch

from chinese_tokenizer import load_tokenizer, text_to_token_ids, token_ids_to_text
from gpt_fast import generate, speed_up
from gpt_model import GPTModel, get_preset
from plumbing.batching import BatchSchedule, spread_subset
from plumbing.checkpoint import check_output_dir, check_vocab, load_backbone
from plumbing.cli import UserError, add_optimizer_argument, default_path, fill_defaults, run, stage_parser
from plumbing.devices import forked_rng
from plumbing.documents import load_text_documents
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.token_cache import PackedBlocks
from plumbing.training import StageRun, evaluate_lm, make_accelerator

# Run length and optimisation per preset; every value can be overridden on the command line.
DEFAULTS = {
    "tiny": dict(max_steps=40, batch_size=8, learning_rate=3e-3, warmup_steps=4, eval_every=20, eval_examples=16,
                 optimizer="adamw"),
    # the winner of sweep_pretrain.py: bench/README.md, "The demo recipes"; 0.98M tokens (0.4 epoch)
    "demo": dict(max_steps=480, batch_size=16, context_length=128, learning_rate=2e-3, warmup_steps=40,
                 eval_every=160, eval_examples=96, optimizer="muon"),
    "gpt2-zh-small": dict(max_steps=20000, batch_size=16, learning_rate=6e-4, warmup_steps=1000, eval_every=500,
                          eval_examples=400, save_every=1000, optimizer="adamw"),
    "uer-gpt2-chinese": dict(max_steps=20000, batch_size=8, learning_rate=1e-4, warmup_steps=500, eval_every=500,
                             eval_examples=400, save_every=1000, optimizer="adamw"),
}
SAMPLE_PROMPT = "中国"


def parse_args(argv=None):
    p = stage_parser("Stage 0: pretrain a GPT-2 on Chinese text (next-token prediction).",
                     default_path("checkpoints", "pretrain"), DEFAULTS, examples="validation blocks of text",
                      new_model=True)
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "pretrain", "train.jsonl")],
                   help=".txt (documents separated by blank lines), .jsonl/.json/.parquet (the text in --text_field) "
                        "files, folders or globs, or a datasets dataset: a Hub name as NAME, NAME:SPLIT or "
                        "NAME:CONFIG:SPLIT (split default: train), or a local dataset folder")
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "pretrain", "val.jsonl")],
                   help="held-out documents (same forms as --train_files) for the validation loss")
    p.add_argument("--text_field", default="text",
                   help="the field (.jsonl/.json), column (.parquet, datasets) that holds each document's text")
    p.add_argument("--init", help="start from this stage checkpoint's weights instead of a new model")
    p.add_argument("--init_from_hf", help="start from a local Hugging Face directory: GPT-2 (e.g. uer's), or an "
                   "export of load_weight.py (see there)")
    p.add_argument("--context_length", type=int,
                   help="block length (default: the preset's, else the model's context_length)")
    add_optimizer_argument(p)
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS[args.preset])
    if args.init and args.init_from_hf:
        raise UserError("give either --init or --init_from_hf, not both")
    return args


def build_model(args, tokenizer):
    """A new model of the preset, or the weights of --init / --init_from_hf; returns (model, parent metadata)."""
    if args.init_from_hf:
        from plumbing.hf_weights import load_hf_model

        model, parent = load_hf_model(args.init_from_hf, want="gpt"), {"parent": os.path.abspath(args.init_from_hf)}
    elif args.init:
        return load_backbone(args.init, "--init", tokenizer, "0-PRETRAIN.py")
    else:
        model, parent = GPTModel(get_preset(args.preset)), {"parent": None}
    check_vocab(tokenizer, model.cfg.vocab_size, f"--tokenizer {args.tokenizer}", "use the matching --tokenizer")
    return model, parent


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- model -------------------------------------------------------------------------------------------------
    model, parent = build_model(args, tokenizer)
    speed_up(model)  # the same model, its loss and decoding paths fast (gpt_fast.py)
    block_len = args.context_length or model.cfg.context_length
    if not 1 < block_len <= model.cfg.context_length:
        raise UserError(f"--context_length {block_len} must be in 2..{model.cfg.context_length} (the model's "
                        f"positions)")

    # --- data: documents -> tokens -> blocks of block_len next-token predictions ---------------------------------
    with accelerator.main_process_first():  # the first process fills the datasets cache, the others reuse it
        # documents start as the model's did in training: with [CLS] for uer's weights, with nothing for ours
        train_documents = load_text_documents(args.train_files, "--train_files", args.text_field)
        val_documents = load_text_documents(args.val_files, "--val_files", args.text_field)
        train = PackedBlocks(train_documents, tokenizer, block_len, "train", model.cfg.bos_id)
        val = PackedBlocks(val_documents, tokenizer, block_len, "val", model.cfg.bos_id)
    for path in sorted(set(train_documents.files) & set(val_documents.files)):  # e.g. a folder given as training
        accelerator.print(f"warning: {path} is in both --train_files and --val_files, so the validation loss "
                          f"also measures text the model trains on; give the two sets apart")
    eval_blocks = spread_subset(len(val), args.eval_examples)  # a fixed subset keeps each evaluation short
    schedule = BatchSchedule(len(train), args.batch_size, args.gradient_accumulation_steps,
                             accelerator.num_processes, args.seed)
    accelerator.print(f"train: {train.num_documents} documents, {len(train.tokens):,} tokens, {len(train)} blocks; "
                      f"val: {len(val)} blocks; {sum(p.numel() for p in model.parameters()):,} parameters; "
                      f"global batch {schedule.global_batch_size} x {block_len} tokens")

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -----------------------
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)
    stage = StageRun("pretrain", args, accelerator, model, optimizer, tokenizer, parent,
                     plot=("loss_curve.png", ["train_loss", "val_loss"]))

    def evaluate_and_sample():
        """Val loss and perplexity, and a greedy and a sampled continuation of SAMPLE_PROMPT."""
        val_loss = evaluate_lm(model, eval_blocks, val.collate, args.batch_size, accelerator)
        prompt = text_to_token_ids(SAMPLE_PROMPT, tokenizer).to(accelerator.device)
        with forked_rng(accelerator.device):  # sampling must not shift the training RNG (exact resume)
            torch.manual_seed(args.seed)
            greedy = generate(stage.unwrapped_model, prompt, 40, block_len)
            sampled = generate(stage.unwrapped_model, prompt, 40, block_len, temperature=1.0, top_k=40)
        result = {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50)),
                  "greedy": token_ids_to_text(greedy, tokenizer), "sampled": token_ids_to_text(sampled, tokenizer)}
        stage.print(f"step {stage.step}: val loss {val_loss:.3f}, perplexity {result['val_perplexity']:.1f}\n"
                  f"  greedy : {result['greedy']}\n  sampled: {result['sampled']}")
        return result

    # --- the loop ------------------------------------------------------------------------------------------------
    model.train()
    for step in stage.steps():
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))  # warm-up, cosine
        step_loss = 0.0
        for micro in range(args.gradient_accumulation_steps):
            batch = train.collate(schedule.indices(step, micro, accelerator.process_index))
            input_ids, labels = batch["input_ids"].to(accelerator.device), batch["labels"].to(accelerator.device)
            with stage.accumulate():
                loss = model(input_ids, labels=labels)["loss"]  # mean next-token cross-entropy
                accelerator.backward(loss)  # divided by the micro-batches; gradients sync on the last one
            step_loss += loss.item() / args.gradient_accumulation_steps
        if stage.clip_gradients():  # to --max_grad_norm; False: a non-finite gradient, never applied
            optimizer.step()
        optimizer.zero_grad()
        step_loss = stage.end_step(step_loss, tokens=input_ids.numel() * args.gradient_accumulation_steps)
        row = {"train_loss": step_loss}
        if stage.eval_due:
            row.update(evaluate_and_sample())
        stage.log(row, show=("train_loss", "lr"))
    return stage.finish()


if __name__ == "__main__":
    run(main)
