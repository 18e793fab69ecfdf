"""Stage 1 — supervised fine-tuning (SFT): teach the pretrained GPT-2 to answer a prompt, then stop.

Every (prompt, response) pair goes through the one chat template, ``[CLS] prompt [ANS] response [SEP]``, and the
loss is the next-token loss on the response only: the prompt and the padding carry label -100, while the first
response token (predicted at ``[ANS]``) and the closing ``[SEP]`` (the signal to stop) are learned. This is the
"supervised fine-tuning" step of InstructGPT (Ouyang et al. 2022, section 3.5).

Story of the stage: arguments → data (pairs → template ids → shifted, response-only labels; batches of similar
length, right-padded) → model from the pretrain checkpoint → the loop (the same AdamW, warm-up + cosine, clipping
and accumulation as pretraining; response-only val loss and greedy answers to a few fixed val prompts every
``--eval_every`` steps) → checkpoint, with the answers table in ``samples.md``.

    python 1-SFT.py                       # demo preset: checkpoints/pretrain + data/sft -> checkpoints/sft
    accelerate launch 1-SFT.py --preset gpt2-zh-small --init checkpoints/pretrain ...

The model's size comes from the ``--init`` checkpoint; ``--preset`` only picks the run length and optimisation
(the DEFAULTS below).
"""

from __future__ import annotations

import math
import os
import time

import torch
from tqdm.auto import tqdm

from checkpoint import (CONFIG_FILE, check_output_dir, command_line, load_checkpoint, load_weights_into,
                        parent_meta, save_checkpoint)
from chinese_tokenizer import EOS_ID, chat_prompt_ids, decode, load_tokenizer
from cli import UserError, default_path, fill_defaults, positive_int, run, stage_parser
from corpus import ChatPairs, expand_files, length_grouped_batches, read_jsonl
from gpt_model import generate
from training import (BatchSchedule, MetricsLog, StopSignal, Throughput, evaluate_lm, gather_rng_states,
                      load_training_state, lr_at, make_accelerator, make_optimizer, save_between_steps,
                      save_training_state, set_lr, spread_subset)

# Run length and optimisation per preset; every value can be overridden on the command line. The demo run sees
# 300 x 16 = 4800 pairs (about 200k tokens, a third of the training set) and fits in three minutes on 2 CPU cores;
# its peak rate is the demo pretraining's, because the small model has much left to learn about the formats.
DEFAULTS = {
    "tiny": dict(max_steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=3, eval_every=15, eval_examples=16),
    "demo": dict(max_steps=300, batch_size=16, learning_rate=2e-3, warmup_steps=20, eval_every=100,
                 eval_examples=200),
    "gpt2-zh-small": dict(max_steps=3000, batch_size=16, learning_rate=1e-4, warmup_steps=100, eval_every=250,
                          eval_examples=700, save_every=500),
    "uer-gpt2-chinese": dict(max_steps=3000, batch_size=16, learning_rate=5e-5, warmup_steps=100, eval_every=250,
                             eval_examples=700, save_every=500),
}
# The fixed val prompts answered at each evaluation: the first val prompt containing each of these words (review
# writing, both 歇后语 templates, a word definition), then evenly spread val rows up to --num_samples.
SAMPLE_KEYWORDS = ("好评", "差评", "歇后语", "下一句", "解释")
MAX_ANSWER_TOKENS = 64


def parse_args(argv=None):
    p = stage_parser("Stage 1: supervised fine-tuning on (prompt, response) pairs, loss on the response only.",
                     default_path("checkpoints", "sft"), DEFAULTS)
    p.add_argument("--init", default=default_path("checkpoints", "pretrain"),
                   help="the pretrained checkpoint to fine-tune (written by 0-PRETRAIN.py)")
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "sft", "train.jsonl")],
                   help='.jsonl files of {"prompt", "response"} rows')
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "sft", "val.jsonl")],
                   help="held-out prompt/response pairs for the validation response loss and sample answers")
    p.add_argument("--max_length", type=positive_int,
                   help="positions read per pair (default: the model's context_length); longer pairs lose the "
                        "start of their prompt")
    p.add_argument("--num_samples", type=positive_int, default=6, help="fixed val prompts answered at each eval")
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS[args.preset])
    return args


def read_pairs(patterns, what: str) -> list[dict]:
    """Every {"prompt", "response"} row of the files matching ``patterns``, in file order."""
    return [row for path in expand_files(patterns, what) for row in read_jsonl(path, ("prompt", "response"))]


def load_parent(path: str, vocab_size: int):
    """The pretrained model to fine-tune, in train mode, and what the SFT checkpoint records about it."""
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise UserError(f"--init {path}: no pretrained checkpoint there (missing {CONFIG_FILE}); run "
                        f"`python 0-PRETRAIN.py` first or pass --init DIR")
    model, _, _ = load_checkpoint(path, "gpt", expect_vocab_size=vocab_size)
    model.train()
    return model, parent_meta(path)


def pick_sample_rows(rows, count: int) -> list[int]:
    """Indices of the fixed val rows whose prompts are answered at each evaluation (see SAMPLE_KEYWORDS)."""
    picked = []
    for word in SAMPLE_KEYWORDS:
        hit = next((i for i, row in enumerate(rows) if word in row["prompt"]), None)
        if hit is not None and hit not in picked:
            picked.append(hit)
    for i in spread_subset(len(rows), count) + list(range(len(rows))):
        if len(picked) >= count:
            break
        if i not in picked:
            picked.append(i)
    return picked[:count]


def answer(model, prompt: str, tokenizer, context_length: int) -> str:
    """The greedy answer to ``prompt`` under the chat template: generated with the KV cache until ``[SEP]``."""
    ids = chat_prompt_ids(prompt, tokenizer, context_length - 1)  # [CLS] prompt [ANS], one slot left to answer
    idx = torch.tensor([ids], device=next(model.parameters()).device)  # (1, P)
    out = generate(model, idx, MAX_ANSWER_TOKENS, context_length, eos_id=EOS_ID)[0, len(ids):].tolist()
    if EOS_ID in out:
        out = out[:out.index(EOS_ID)]
    return decode(out, tokenizer)


def shown(answer_text: str) -> str:
    """An answer for display: an empty one (``[SEP]`` came first) is written out, not left blank."""
    return answer_text if answer_text else "(empty: [SEP] at once)"


def samples_markdown(table: list[dict], step: int) -> str:
    """The answers as a Markdown table (``|`` and newlines escaped so every answer stays in its cell)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = [f"# SFT greedy answers to fixed val prompts (step {step})", "",
             "| prompt | reference | model |", "|---|---|---|"]
    lines += [f"| {cell(r['prompt'])} | {cell(r['reference'])} | {cell(shown(r['answer']))} |" for r in table]
    return "\n".join(lines) + "\n"


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- model: the pretrained checkpoint (or, on --resume, this run's saved weights) ----------------------------
    model, parent = load_parent(args.init, len(tokenizer))
    if args.resume:
        load_weights_into(model, args.output_dir)
    cfg = model.cfg
    max_length = args.max_length or cfg.context_length
    if not 3 <= max_length <= cfg.context_length:
        raise UserError(f"--max_length {max_length} must be in 3..{cfg.context_length} (the model's positions)")

    # --- data: pairs -> [CLS] prompt [ANS] response [SEP] -> (inputs, response-only labels) ----------------------
    train = ChatPairs(read_pairs(args.train_files, "--train_files"), tokenizer, max_length)
    val = ChatPairs(read_pairs(args.val_files, "--val_files"), tokenizer, max_length)
    for pairs, what in ((train, "train"), (val, "val")):
        if pairs.truncation_warning(what):
            accelerator.print(pairs.truncation_warning(what))
    # Batches of similar length waste little padding; the schedule shuffles whole batches, one per micro-batch.
    batches = length_grouped_batches(train.lengths, args.batch_size)
    schedule = BatchSchedule(len(batches), 1, args.gradient_accumulation_steps, accelerator.num_processes, args.seed)
    eval_pairs = sorted(spread_subset(len(val), args.eval_examples), key=lambda i: val.lengths[i])
    sample_rows = [val.rows[i] for i in pick_sample_rows(val.rows, args.num_samples)]
    accelerator.print(f"train: {len(train)} pairs, {sum(train.lengths):,} tokens, {len(batches)} batches of "
                      f"<= {args.batch_size}; val: {len(val)} pairs ({len(eval_pairs)} per eval); "
                      f"{sum(p.numel() for p in model.parameters()):,} parameters")

    # --- optimizer and Accelerate --------------------------------------------------------------------------------
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    step, tokens_seen, metrics, table = 0, 0, MetricsLog(), []
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
            if table:
                files["samples.md"] = lambda path: write_text(path, samples_markdown(table, step))
            if final:
                files["loss_curve.png"] = lambda path: metrics.plot(path, "sft", ["train_loss", "val_loss"])
            evals = [r for r in metrics.rows if "val_loss" in r]
            scores = {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("val_")}
            if evals and evals[0]["step"] == 0:
                scores["val_loss_before_sft"] = evals[0]["val_loss"]
            meta = {"stage": "sft", **parent, "step": step, "tokens_seen": tokens_seen, "metrics": scores,
                    "command": command_line()}
            state = None if final else (lambda d: save_training_state(
                d, optimizer, {"step": step, "tokens_seen": tokens_seen}, rng))
            save_checkpoint(args.output_dir, accelerator.unwrap_model(model), tokenizer, meta, state, files)
        accelerator.wait_for_everyone()

    def evaluate_and_answer(row: dict) -> None:
        """Response-only val loss into ``row``; greedy answers to the fixed prompts into ``table``, printed."""
        val_loss = evaluate_lm(model, eval_pairs, val.collate, args.batch_size, accelerator)
        row.update(val_loss=val_loss, val_perplexity=math.exp(min(val_loss, 50)))
        table[:] = [{"prompt": r["prompt"], "reference": r["response"],
                     "answer": answer(accelerator.unwrap_model(model), r["prompt"], tokenizer, cfg.context_length)}
                    for r in sample_rows]  # greedy: uses no randomness, so exact resume is unaffected
        row["answers"] = [r["answer"] for r in table]
        lines = "\n".join(f"  {r['prompt']} -> {shown(r['answer'])}" for r in table)
        accelerator.print(f"step {row['step']}: val response loss {val_loss:.3f}, perplexity "
                          f"{row['val_perplexity']:.1f}\n{lines}")

    # --- the loop ------------------------------------------------------------------------------------------------
    started = time.time()
    if step == 0:  # the pretrained model's score: the baseline the fine-tuning must beat
        row = {"step": 0, "tokens_seen": 0, "time_s": 0.0}
        evaluate_and_answer(row)
        metrics.add(**row)
    last_step = min(args.max_steps, step + args.stop_after) if args.stop_after else args.max_steps
    bar = tqdm(total=args.max_steps, initial=step, desc="sft", disable=not accelerator.is_main_process,
               dynamic_ncols=True)
    speed = Throughput()
    model.train()
    with StopSignal() as stop:
        while step < last_step:
            lr = lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps)
            set_lr(optimizer, lr)
            step_loss = 0.0
            for micro in range(args.gradient_accumulation_steps):
                batch = train.collate(batches[schedule.indices(step, micro, accelerator.process_index)[0]])
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                with accelerator.accumulate(model), accelerator.autocast():
                    loss = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                                 labels=batch["labels"])["loss"]  # mean over this batch's response tokens
                    accelerator.backward(loss)  # divides by the accumulation steps once
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                step_loss += loss.item() / args.gradient_accumulation_steps
                speed.add(batch["input_ids"].numel() * accelerator.num_processes)
                # real tokens read by every process this micro-batch (computable anywhere: the schedule is shared)
                tokens_seen += sum(train.lengths[i] for rank in range(accelerator.num_processes)
                                   for i in batches[schedule.indices(step, micro, rank)[0]])
            if not math.isfinite(step_loss):
                raise UserError(f"the training loss became {step_loss} at step {step + 1}; the last good checkpoint "
                                f"(if any) is in {args.output_dir}; lower --learning_rate and start again")
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{speed.rate():.0f}")
            row = {"step": step, "train_loss": step_loss, "lr": lr, "tokens_seen": tokens_seen,
                   "time_s": round(time.time() - started, 1)}
            if step % args.eval_every == 0 or step == args.max_steps:
                evaluate_and_answer(row)
            metrics.add(**row)
            interrupted = save_between_steps(stop, accelerator, step, args, lambda: save(final=False))
            if interrupted is not None:
                return interrupted
    bar.close()
    save(final=step >= args.max_steps)
    if step < args.max_steps:
        accelerator.print(f"stopped after step {step} of {args.max_steps}; continue with --resume")
    else:
        before = next((r["val_loss"] for r in metrics.rows if r["step"] == 0 and "val_loss" in r), None)
        change = f"{before:.3f} -> " if before is not None else ""
        accelerator.print(f"saved {args.output_dir} (step {step}, {tokens_seen:,} tokens, val response loss "
                          f"{change}{metrics.rows[-1].get('val_loss', float('nan')):.3f}, "
                          f"{time.time() - started:.0f} s); answers in {os.path.join(args.output_dir, 'samples.md')}")
    return 0


if __name__ == "__main__":
    run(main)
