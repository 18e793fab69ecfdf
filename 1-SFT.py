"""Stage 1 — supervised fine-tuning (SFT): teach the pretrained GPT-2 to answer a prompt, then stop.

Every (prompt, response) pair goes through the one chat template, ``[CLS] prompt [ANS] response [SEP]``, and the
loss is the next-token loss on the response only: the prompt and the padding carry label -100, while the first
response token (predicted at ``[ANS]``) and the closing ``[SEP]`` (the signal to stop) are learned. This is the
"supervised fine-tuning" step of InstructGPT (Ouyang et al. 2022, section 3.5). Conversations of several turns
(``{"messages": [...]}`` files) go through the same template turn after turn, and every assistant turn is learned;
alpaca files (``{"instruction", "input", "output"}``) are one exchange each (``records.CHAT_FORMATS``).

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

import torch

from chinese_tokenizer import EOS_ID, chat_messages_ids, decode, load_tokenizer, until_eos
from gpt_fast import generate, speed_up
from lora import add_lora, trainable_parameters
from plumbing.batching import BatchSchedule, ChatPairs, length_grouped_batches, spread_subset
from plumbing.checkpoint import check_output_dir, load_backbone
from plumbing.cli import (
    UserError,
    add_lora_arguments,
    add_optimizer_argument,
    check_lora_arguments,
    default_path,
    fill_defaults,
    positive_int,
    run,
    stage_parser,
)
from plumbing.markdown import markdown_table
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.records import read_chat_pairs
from plumbing.training import StageRun, evaluate_lm, make_accelerator

# Run length and optimisation per preset; every value can be overridden on the command line. The demo run sees
# 320 x 16 = 5120 pairs (about 220k tokens, a third of the training set) in about two minutes on 2 CPU cores.
DEFAULTS = {
    "tiny": dict(max_steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=3, eval_every=15, eval_examples=16,
                 optimizer="adamw"),
    # steps: bench/README.md, "A second family"; the rate: the demo pretraining's, "The demo recipes"
    "demo": dict(max_steps=320, batch_size=16, learning_rate=2e-3, warmup_steps=20, eval_every=100,
                 eval_examples=200, optimizer="adamw"),
    "gpt2-zh-small": dict(max_steps=3000, batch_size=16, learning_rate=1e-4, warmup_steps=100, eval_every=250,
                          eval_examples=700, save_every=500, optimizer="adamw"),
    "uer-gpt2-chinese": dict(max_steps=3000, batch_size=16, learning_rate=5e-5, warmup_steps=100, eval_every=250,
                             eval_examples=700, save_every=500, optimizer="adamw"),
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
    p.add_argument("--train_files", nargs="+",
                   default=[default_path("data", "sft", "train.jsonl"),
                            default_path("data", "instructions", "sft.jsonl"),
                            default_path("data", "sentiment", "sft.jsonl")],
                   help='.jsonl, .json (an array) or .parquet files of {"prompt", "response"}, alpaca {"instruction", '
                        '"input", "output"} or {"messages": [{"role", "content"}, ...]} records, told apart per file '
                        '(default: data/sft/train.jsonl, the chat pairs, and data/instructions/sft.jsonl and '
                        'data/sentiment/sft.jsonl, the examples of the two verifiable families, which the verifiable '
                        'path of 3-GRPO.py and 3-PPO.py starts from)')
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "sft", "val.jsonl")],
                   help="held-out prompt/response pairs for the validation response loss and sample answers")
    p.add_argument("--system", help="a system text for every conversation that has none of its own ([CLS] system "
                                    "[SEP] user [ANS] ...); give generate.py the same --system when chatting")
    p.add_argument("--max_length", type=positive_int,
                   help="positions read per pair (default: the model's context_length); longer pairs lose the "
                        "start of their prompt")
    p.add_argument("--num_samples", type=positive_int, default=6, help="fixed val prompts answered at each eval")
    add_optimizer_argument(p)
    add_lora_arguments(p)
    args = p.parse_args(argv)
    fill_defaults(args, DEFAULTS[args.preset])
    check_lora_arguments(args)
    return args


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


def answer(model, messages, tokenizer, context_length: int) -> str:
    """The greedy next assistant turn after ``messages`` (ending with a user turn) under the chat template,
    generated with the KV cache until ``[SEP]``."""
    ids = chat_messages_ids(messages, tokenizer, context_length - 1)  # ... [ANS], one slot left to answer
    idx = torch.tensor([ids], device=next(model.parameters()).device)  # (1, P)
    out = generate(model, idx, MAX_ANSWER_TOKENS, context_length, eos_id=EOS_ID)[0, len(ids):].tolist()
    return decode(until_eos(out), tokenizer)


def shown(answer_text: str) -> str:
    """An answer for display: an empty one (``[SEP]`` came first) is written out, not left blank."""
    return answer_text if answer_text else "(empty: [SEP] at once)"


def samples_markdown(table: list[dict], step: int) -> str:
    """The answers to the fixed val prompts as Markdown: a title, then one table row per prompt."""
    rows = [(r["prompt"], r["reference"], shown(r["answer"])) for r in table]
    return (f"# SFT greedy answers to fixed val prompts (step {step})\n\n"
            + markdown_table(("prompt", "reference", "model"), rows))


def write_samples(path: str, table: list[dict], step: int) -> None:
    """``samples.md`` of the checkpoint, if the answers have been computed in this run."""
    if table:
        with open(path, "w", encoding="utf-8") as f:
            f.write(samples_markdown(table, step))


def read_pairs(args, split: str, tokenizer, max_length: int, print_=print) -> ChatPairs:
    """The conversations of ``--{split}_files`` (``split``: train or val) encoded to at most ``max_length``
    positions; prints a warning when some had to be cut.

    Raises:
        UserError: a file is missing or malformed (``read_chat_pairs``).
    """
    pairs = ChatPairs(read_chat_pairs(getattr(args, f"{split}_files"), f"--{split}_files", args.system), tokenizer,
                      max_length)
    if pairs.truncation_warning(split):
        print_(pairs.truncation_warning(split))
    return pairs


def build_model(args, tokenizer):
    """The pretrained checkpoint of --init, sped up (gpt_fast.py) and given LoRA adapters with --lora_rank; returns
    (model, parent metadata, max_length: the positions each example may read). Raises ``UserError`` for a missing
    checkpoint or a --max_length outside 3..context_length."""
    model, parent = load_backbone(args.init, "--init", tokenizer, "0-PRETRAIN.py")
    speed_up(model)  # the same model, its loss and decoding paths fast (gpt_fast.py)
    cfg = model.cfg
    if args.lora_rank:  # LoRA: only the adapters train; the checkpoint holds them alone, over --init (lora.py)
        add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets, dropout=cfg.drop_rate)
    max_length = args.max_length or cfg.context_length
    if not 3 <= max_length <= cfg.context_length:
        raise UserError(f"--max_length {max_length} must be in 3..{cfg.context_length} (the model's positions)")
    return model, parent, max_length


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- model: the pretrained checkpoint ----------------------------------------------------------------------
    model, parent, max_length = build_model(args, tokenizer)
    cfg = model.cfg

    # --- data: pairs -> [CLS] prompt [ANS] response [SEP] -> (inputs, response-only labels) ----------------------
    # (a conversation of several turns: [CLS] user [ANS] assistant [SEP] user [ANS] ..., every assistant turn learned)
    train, val = (read_pairs(args, split, tokenizer, max_length, accelerator.print) for split in ("train", "val"))
    # Batches of similar length waste little padding; the schedule shuffles whole batches, one per micro-batch.
    batches = length_grouped_batches(train.lengths, args.batch_size)
    eval_pairs = sorted(spread_subset(len(val), args.eval_examples), key=lambda i: val.lengths[i])
    accelerator.print(f"train: {len(train)} pairs, {sum(train.lengths):,} tokens, {len(batches)} batches of "
                      f"<= {args.batch_size}; val: {len(val)} pairs ({len(eval_pairs)} per eval); "
                      f"{sum(p.numel() for p in model.parameters()):,} parameters, {trainable_parameters(model):,} "
                      f"trained")
    schedule = BatchSchedule(len(batches), 1, args.gradient_accumulation_steps, accelerator.num_processes, args.seed)
    sample_rows = [val.rows[i] for i in pick_sample_rows(val.rows, args.num_samples)]

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -----------------------
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)
    stage = StageRun("sft", args, accelerator, model, optimizer, tokenizer, parent,
                     plot=("loss_curve.png", ["train_loss", "val_loss"]))
    table = []  # the latest greedy answers to the fixed prompts
    stage.files["samples.md"] = lambda path: write_samples(path, table, stage.step)

    def answer_the_samples() -> None:
        """Greedy answers to the fixed prompts into ``table`` (greedy uses no randomness: exact resume holds)."""
        table[:] = [{"prompt": r["prompt"], "reference": r["response"],
                     "answer": answer(stage.unwrapped_model, r["messages"][:-1], tokenizer, cfg.context_length)}
                    for r in sample_rows]

    def evaluate_and_answer() -> dict:
        """Response-only val loss and perplexity; greedy answers to the fixed prompts into ``table``, printed."""
        val_loss = evaluate_lm(model, eval_pairs, val.collate, args.batch_size, accelerator)
        answer_the_samples()
        lines = "\n".join(f"  {r['prompt']} -> {shown(r['answer'])}" for r in table)
        stage.print(f"step {stage.step}: val response loss {val_loss:.3f}, perplexity "
                    f"{math.exp(min(val_loss, 50)):.1f}\n{lines}")
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50)),
                "answers": [r["answer"] for r in table]}

    # --- the loop ------------------------------------------------------------------------------------------------
    if stage.step == 0:  # the pretrained model's score: the baseline the fine-tuning must beat
        stage.log(evaluate_and_answer())
    stage.results["val_loss_before_sft"] = stage.metrics.rows[0]["val_loss"]
    model.train()
    for step in stage.steps():
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))  # warm-up, cosine
        step_loss, tokens = 0.0, 0
        for micro in range(args.gradient_accumulation_steps):
            batch = train.collate(batches[schedule.indices(step, micro, accelerator.process_index)[0]])
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with stage.accumulate():
                loss = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["labels"])["loss"]  # mean over this batch's response tokens
                accelerator.backward(loss)  # divided by the micro-batches; gradients sync on the last one
            step_loss += loss.item() / args.gradient_accumulation_steps
            tokens += int(batch["attention_mask"].sum())
        if stage.clip_gradients():  # to --max_grad_norm; False: a non-finite gradient, never applied
            optimizer.step()
        optimizer.zero_grad()
        row = {"train_loss": stage.end_step(step_loss, tokens)}
        if stage.eval_due:
            row.update(evaluate_and_answer())
        stage.log(row, show=("train_loss", "lr"))
    if not table:  # resumed after its last evaluation (a Ctrl-C at the last step): samples.md needs the answers
        answer_the_samples()
    before, after = stage.results["val_loss_before_sft"], stage.latest_val().get("val_loss", float("nan"))
    return stage.finish(f"val response loss {before:.3f} -> {after:.3f}; answers in "
                        f"{os.path.join(args.output_dir, 'samples.md')}")


if __name__ == "__main__":
    run(main)
