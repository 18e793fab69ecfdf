"""Stage 0 — pretraining: teach a GPT-2 to continue Chinese text by predicting each next token.

Story of the stage: arguments → data (documents tokenized and packed into blocks) → model (new, or from a
checkpoint / public GPT-2 weights) → the loop (AdamW, warm-up + cosine, gradient accumulation and clipping through
Accelerate; eval loss, perplexity and two sample continuations every ``--eval_every`` steps) → checkpoint.

    python 0-PRETRAIN.py                      # demo preset on data/pretrain/, writes checkpoints/pretrain/
    accelerate launch 0-PRETRAIN.py --preset gpt2-zh-small --mixed_precision bf16 ...
"""

from __future__ import annotations

import math
import os
import time

import torch
from tqdm.auto import tqdm

from checkpoint import (check_output_dir, check_vocab, command_line, load_weights_into, parent_meta, read_config,
                        save_checkpoint)
from chinese_tokenizer import load_tokenizer
from cli import UserError, default_path, fill_defaults, run, stage_parser
from corpus import PackedBlocks, load_text_documents
from gpt_model import GPTConfig, GPTModel, generate, get_preset, text_to_token_ids, token_ids_to_text
from training import (BatchSchedule, MetricsLog, StopSignal, Throughput, evaluate_lm, gather_rng_states,
                      load_training_state, lr_at, make_accelerator, make_optimizer, mean_over_processes,
                      save_between_steps, save_training_state, set_lr, spread_subset)

# Run length and optimisation per preset; every value can be overridden on the command line.
DEFAULTS = {
    "tiny": dict(max_steps=40, batch_size=8, learning_rate=3e-3, warmup_steps=4, eval_every=20, eval_examples=16),
    "demo": dict(max_steps=240, batch_size=8, learning_rate=2e-3, warmup_steps=20, eval_every=80,
                 eval_examples=48),
    "gpt2-zh-small": dict(max_steps=20000, batch_size=16, learning_rate=6e-4, warmup_steps=1000, eval_every=500,
                          eval_examples=400, save_every=1000),
    "uer-gpt2-chinese": dict(max_steps=20000, batch_size=8, learning_rate=1e-4, warmup_steps=500, eval_every=500,
                             eval_examples=400, save_every=1000),
}
SAMPLE_PROMPT = "中国"


def parse_args(argv=None):
    p = stage_parser("Stage 0: pretrain a GPT-2 on Chinese text (next-token prediction).",
                     default_path("checkpoints", "pretrain"), DEFAULTS)
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "pretrain", "train.jsonl")],
                   help=".txt (documents separated by blank lines) or .jsonl ({\"text\"}) files or globs")
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "pretrain", "val.jsonl")],
                   help="held-out documents (same formats as --train_files) for the validation loss")
    p.add_argument("--init", help="start from this stage checkpoint's weights instead of a new model")
    p.add_argument("--init_from_hf", help="start from a local Hugging Face GPT-2 directory (see load_weight.py)")
    p.add_argument("--context_length", type=int, help="block length (default: the model's context_length)")
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS[args.preset])
    if args.init and args.init_from_hf:
        raise UserError("give either --init or --init_from_hf, not both")
    return args


def build_model(args):
    """A new model of the preset, or the weights of --init / --init_from_hf; returns (model, parent metadata)."""
    if args.init_from_hf:
        from load_weight import load_hf_gpt2

        return load_hf_gpt2(args.init_from_hf), {"parent": os.path.abspath(args.init_from_hf)}
    if args.init:
        model = GPTModel(GPTConfig.from_dict(read_config(args.init)["model"]))
        load_weights_into(model, args.init)
        return model, parent_meta(args.init)
    return GPTModel(get_preset(args.preset)), {"parent": None}


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- model -------------------------------------------------------------------------------------------------
    model, parent = build_model(args)
    if args.resume:
        load_weights_into(model, args.output_dir)
    cfg = model.cfg
    check_vocab(tokenizer, cfg.vocab_size, f"--tokenizer {args.tokenizer}", "use the matching --tokenizer")
    block_len = args.context_length or cfg.context_length
    if not 1 < block_len <= cfg.context_length:
        raise UserError(f"--context_length {block_len} must be in 2..{cfg.context_length} (the model's positions)")

    # --- data: documents -> tokens -> blocks of block_len next-token predictions ---------------------------------
    with accelerator.main_process_first():  # the first process fills the datasets cache, the others reuse it
        train = PackedBlocks(load_text_documents(args.train_files, "--train_files"), tokenizer, block_len, "train")
        val = PackedBlocks(load_text_documents(args.val_files, "--val_files"), tokenizer, block_len, "val")
    eval_blocks = spread_subset(len(val), args.eval_examples)  # a fixed subset keeps each evaluation short
    schedule = BatchSchedule(len(train), args.batch_size, args.gradient_accumulation_steps,
                             accelerator.num_processes, args.seed)
    accelerator.print(f"train: {train.num_documents} documents, {len(train.tokens):,} tokens, {len(train)} blocks; "
                      f"val: {len(val)} blocks; {sum(p.numel() for p in model.parameters()):,} parameters; "
                      f"global batch {schedule.global_batch_size} x {block_len} tokens")

    # --- optimizer and Accelerate --------------------------------------------------------------------------------
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    step, tokens_seen, metrics = 0, 0, MetricsLog()
    if args.resume:
        trainer = load_training_state(os.path.join(args.output_dir, "state"), optimizer, accelerator)
        step, tokens_seen = trainer["step"], trainer["tokens_seen"]
        metrics = MetricsLog.resume(os.path.join(args.output_dir, "metrics.jsonl"), step)
        accelerator.print(f"resumed at step {step}")

    def save(final: bool):
        """Write the checkpoint (with a resumable state unless the run is complete)."""
        rng = gather_rng_states(accelerator)
        if accelerator.is_main_process:
            files = {"metrics.jsonl": metrics.write}
            if final:
                files["loss_curve.png"] = lambda path: metrics.plot(path, "pretrain", ["train_loss", "val_loss"])
            last = metrics.rows[-1] if metrics.rows else {}
            meta = {"stage": "pretrain", **parent, "step": step, "tokens_seen": tokens_seen,
                    "metrics": {k: v for k, v in last.items() if k.startswith("val_")}, "command": command_line()}
            state = None if final else (lambda d: save_training_state(
                d, optimizer, {"step": step, "tokens_seen": tokens_seen}, rng))
            save_checkpoint(args.output_dir, accelerator.unwrap_model(model), tokenizer, meta, state, files)
        accelerator.wait_for_everyone()

    def evaluate_and_sample():
        val_loss = evaluate_lm(model, eval_blocks, val.collate, args.batch_size, accelerator)
        prompt = text_to_token_ids(SAMPLE_PROMPT, tokenizer).to(accelerator.device)
        with torch.random.fork_rng(devices=[]):  # sampling must not shift the training RNG (exact resume)
            torch.manual_seed(args.seed)
            greedy = generate(accelerator.unwrap_model(model), prompt, 40, block_len)
            sampled = generate(accelerator.unwrap_model(model), prompt, 40, block_len, temperature=1.0, top_k=40)
        return val_loss, token_ids_to_text(greedy, tokenizer), token_ids_to_text(sampled, tokenizer)

    # --- the loop ------------------------------------------------------------------------------------------------
    last_step = min(args.max_steps, step + args.stop_after) if args.stop_after else args.max_steps
    bar = tqdm(total=args.max_steps, initial=step, desc="pretrain", disable=not accelerator.is_main_process,
               dynamic_ncols=True)
    speed, started = Throughput(), time.time()
    model.train()
    with StopSignal() as stop:
        while step < last_step:
            lr = lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps)
            set_lr(optimizer, lr)
            step_loss = 0.0
            for micro in range(args.gradient_accumulation_steps):
                batch = train.collate(schedule.indices(step, micro, accelerator.process_index))
                input_ids, labels = batch["input_ids"].to(accelerator.device), batch["labels"].to(accelerator.device)
                with accelerator.accumulate(model), accelerator.autocast():
                    loss = model(input_ids, labels=labels)["loss"]  # mean next-token cross-entropy
                    accelerator.backward(loss)  # divides by the accumulation steps once
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                step_loss += loss.item() / args.gradient_accumulation_steps
                speed.add(input_ids.numel() * accelerator.num_processes)
            step_loss, = mean_over_processes(accelerator, [step_loss])  # each process saw part of the batch
            if not math.isfinite(step_loss):
                raise UserError(f"the training loss became {step_loss} at step {step + 1}; the last good checkpoint "
                                f"(if any) is in {args.output_dir}; lower --learning_rate and start again")
            step += 1
            tokens_seen += schedule.global_batch_size * block_len
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{speed.rate():.0f}")
            row = {"step": step, "train_loss": step_loss, "lr": lr, "tokens_seen": tokens_seen,
                   "time_s": round(time.time() - started, 1)}
            if step % args.eval_every == 0 or step == args.max_steps:
                val_loss, greedy, sampled = evaluate_and_sample()
                row.update(val_loss=val_loss, val_perplexity=math.exp(min(val_loss, 50)), greedy=greedy,
                           sampled=sampled)
                bar.write(f"step {step}: val loss {val_loss:.3f}, perplexity {math.exp(min(val_loss, 50)):.1f}\n"
                          f"  greedy : {greedy}\n  sampled: {sampled}")
            metrics.add(**row)
            interrupted = save_between_steps(stop, accelerator, step, args, lambda: save(final=False))
            if interrupted is not None:
                return interrupted
    bar.close()
    save(final=step >= args.max_steps)
    if step < args.max_steps:
        accelerator.print(f"stopped after step {step} of {args.max_steps}; continue with --resume")
    else:
        accelerator.print(f"saved {args.output_dir} (step {step}, {tokens_seen:,} tokens, "
                          f"{time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    run(main)
