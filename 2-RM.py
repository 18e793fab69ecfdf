"""Stage 2 — reward model: learn one number per answer that is higher for the answer people prefer.

Story of the stage: arguments → data (preference pairs; each side laid out by the chat template
``[CLS] prompt [ANS] response [SEP]``, exactly what PPO will generate) → model (the SFT checkpoint's GPT as the
backbone plus a new ``Linear(emb_dim, 1)`` head read at each sequence's last real token: ``gpt_model.RewardModel``)
→ the loop (chosen and rejected sides in one right-padded forward pass, Bradley–Terry loss
``-log sigmoid(r_chosen - r_rejected)`` as in InstructGPT; val accuracy and margin every ``--eval_every`` steps)
→ test accuracy and margin → checkpoint (``model_type: "reward"``, loadable by 3-PPO.py and generate.py --reward).

A pointwise objective is also available: ``--objective pointwise`` trains binary cross-entropy on the score, from
``{"text", "label"}`` lines (label 1 good, 0 bad; an optional "prompt") or from pair lines (chosen 1, rejected 0).

    python 2-RM.py                                    # demo preset: --init checkpoints/sft, writes checkpoints/rm
    python 2-RM.py --score --text "房间很干净，服务也好。" --text "太吵了，再也不来。"   # one score per line
    python 2-RM.py --score --checkpoint checkpoints/rm --texts_file answers.jsonl
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

from chinese_tokenizer import apply_chat_template, load_tokenizer
from gpt_fast import speed_up
from gpt_model import RewardModel
from plumbing.batching import BatchSchedule, length_grouped_batches, pad_right, spread_subset
from plumbing.checkpoint import check_output_dir, load_backbone, load_checkpoint
from plumbing.cli import UserError, default_path, fill_defaults, positive_float, positive_int, run, stage_parser
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.records import expand_files, non_blank_lines, read_jsonl, read_preference_pairs
from plumbing.reward import pairs_ranked_right, score_texts
from plumbing.training import StageRun, make_accelerator

# Run length and optimisation per preset; every value can be overridden on the command line. The model's shape
# comes from --init, so the preset only sets how long and how fast to train. With its prompt a review is at most
# ~135 tokens, so max_length 128 cuts about 1% of the pairs.
DEFAULTS = {
    "tiny": dict(max_steps=30, batch_size=8, learning_rate=2e-3, warmup_steps=3, eval_every=15, eval_examples=64,
                 max_length=64, head_lr_scale=10.0, embedding_lr_scale=1.0),
    # one epoch of the 4843 pairs; the embedding at 30x the rate: bench/README.md, "The demo recipes"
    "demo": dict(max_steps=300, batch_size=16, learning_rate=5e-4, warmup_steps=15, eval_every=100,
                 eval_examples=300, max_length=128, head_lr_scale=10.0, embedding_lr_scale=30.0),
    "gpt2-zh-small": dict(max_steps=1500, batch_size=16, learning_rate=2e-5, warmup_steps=100, eval_every=250,
                          eval_examples=1000, max_length=256, head_lr_scale=10.0, save_every=500,
                          embedding_lr_scale=1.0),
    "uer-gpt2-chinese": dict(max_steps=1500, batch_size=16, learning_rate=1e-5, warmup_steps=100, eval_every=250,
                             eval_examples=1000, max_length=256, head_lr_scale=10.0, save_every=500,
                             embedding_lr_scale=1.0),
}


def parse_args(argv=None):
    p = stage_parser("Stage 2: train a reward model on preference pairs (Bradley–Terry loss), or score texts with "
                     "one (--score).", default_path("checkpoints", "rm"), DEFAULTS)
    p.add_argument("--init", default=default_path("checkpoints", "sft"),
                   help="checkpoint whose GPT weights start the backbone: the SFT stage's output (a reward "
                        "checkpoint gives its backbone; the scalar head always starts new)")
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "rm", "train.jsonl")],
                   help='.jsonl files or globs of {"prompt","chosen","rejected"} lines, or chosen/rejected '
                        'conversations (lists of {"role","content"}); pointwise: {"text","label"} lines too')
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "rm", "val.jsonl")],
                   help="preference pairs for accuracy and margin during training")
    p.add_argument("--test_files", nargs="+", default=[default_path("data", "rm", "test.jsonl")],
                   help="preference pairs scored once at the end of the run")
    p.add_argument("--objective", default="pairwise", choices=["pairwise", "pointwise"],
                   help="pairwise: -log sigmoid(r_chosen - r_rejected); pointwise: binary cross-entropy on labels")
    p.add_argument("--head_lr_scale", type=positive_float,
                   help="the new scalar head's learning rate is --learning_rate times this (the backbone is "
                         "pretrained)")
    p.add_argument("--embedding_lr_scale", type=positive_float,
                   help="the embedding tables' learning rate is --learning_rate times this: the RM learns which "
                        "tokens read as good or bad mostly there")
    p.add_argument("--max_length", type=positive_int,
                   help="longest sequence in tokens; a longer pair loses the start of its prompt, then the end of "
                        "its response (default: the preset's when training, the model's context when scoring)")
    scoring = p.add_argument_group("scoring (prints one score per text on stdout; no training)")
    scoring.add_argument("--score", action="store_true", help="score texts with --checkpoint instead of training")
    scoring.add_argument("--checkpoint", default=default_path("checkpoints", "rm"), help="reward model to score with")
    scoring.add_argument("--text", action="append", default=[], help="a response to score (repeatable)")
    scoring.add_argument("--texts_file",
                         help='a file of responses: one per line, or .jsonl with "text" or "prompt"+"response"')
    scoring.add_argument("--prompt", default="", help="the prompt placed before each --text and each plain line")
    args = p.parse_args(argv)
    if args.score:
        if not args.text and not args.texts_file:
            raise UserError("--score needs something to score; give --text \"...\" (repeatable) or --texts_file FILE")
        return args
    if args.text or args.texts_file:
        raise UserError("--text/--texts_file are for scoring; add --score (and --checkpoint) to score them")
    return fill_defaults(args, DEFAULTS[args.preset])


# --- the objectives: pairwise (Bradley–Terry) and pointwise ----------------------------------------------------

def pairwise_loss(r_chosen, r_rejected):
    """Mean of ``-log sigmoid(r_chosen - r_rejected)`` over (N,) rewards, in float32.

    It is the negative log-likelihood of the preference under the Bradley–Terry model
    ``P(chosen beats rejected) = sigmoid(r_chosen - r_rejected)``: log 2 = 0.693 when the two score the same,
    towards 0 as the margin grows. ``logsigmoid`` stays finite for large negative margins.
    """
    return -F.logsigmoid((r_chosen - r_rejected).float()).mean()


def pointwise_loss(rewards, labels):
    """Binary cross-entropy of (N,) rewards used as logits against (N,) labels 1 (good) / 0 (bad), in float32."""
    return F.binary_cross_entropy_with_logits(rewards.float(), labels.float())


def pair_metrics(r_chosen, r_rejected) -> dict:
    """``{"loss", "accuracy", "margin"}`` over (N,) rewards of N pairs.

    accuracy: the share of pairs with ``r_chosen > r_rejected``, a tie counting half (``reward.pairs_ranked_right``,
    the rule of every pair accuracy in the project); margin: the mean of ``r_chosen - r_rejected``; loss:
    ``pairwise_loss``.
    """
    r_chosen, r_rejected = torch.as_tensor(r_chosen).float(), torch.as_tensor(r_rejected).float()
    diff = r_chosen - r_rejected  # (N,)
    return {"loss": pairwise_loss(r_chosen, r_rejected).item(),
            "accuracy": (pairs_ranked_right(r_chosen, r_rejected) / len(diff)).item(), "margin": diff.mean().item()}


# --- data ----------------------------------------------------------------------------------------------------------

def read_labelled(patterns, what: str) -> list[tuple[str, str, float]]:
    """(prompt, text, label) rows for the pointwise objective. A file of pairs gives two rows per pair (chosen 1,
    rejected 0); a file of ``{"text", "label"}`` lines (optional "prompt") gives one row per line.

    Raises:
        UserError: a line lacks the fields, or a label is not 0 or 1.
    """
    rows = []
    for path in expand_files(patterns, what):
        if "chosen" in read_jsonl(path, ())[0]:  # the first line tells the file's format
            for prompt, chosen, rejected in read_preference_pairs(path, what):
                rows += [(prompt, chosen, 1.0), (prompt, rejected, 0.0)]
            continue
        for i, r in enumerate(read_jsonl(path, ("text",)), start=1):
            if r.get("label") not in (0, 1):  # also accepts true/false and 0.0/1.0
                raise UserError(f"{path} row {i}: \"label\" must be 0 or 1, got {r.get('label')!r}; "
                                f"label good texts 1 and bad texts 0")
            rows.append((r.get("prompt", ""), r["text"], float(r["label"])))
    return rows


def texts_to_score(args) -> tuple[list[str], list[str]]:
    """(prompts, responses) from --text and --texts_file. Raises ``UserError`` for a bad file."""
    prompts, responses = [args.prompt] * len(args.text), list(args.text)
    if args.texts_file:
        path = args.texts_file
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "not found"
            raise UserError(f"--texts_file {path} {what}; give a text file (one response per line) or a .jsonl")
        if path.endswith(".jsonl"):
            fields = ("prompt", "response") if "response" in read_jsonl(path, ())[0] else ("text",)
            for r in read_jsonl(path, fields):
                prompts.append(r["prompt"] if "prompt" in fields else r.get("prompt", args.prompt))
                responses.append(r["response"] if "response" in fields else r["text"])
        else:
            lines = non_blank_lines(path, "--texts_file", one_per="score")
            if not lines:
                raise UserError(f"--texts_file {path} holds no text; give one response per line")
            prompts += [args.prompt] * len(lines)
            responses += lines
    return prompts, responses


# --- scoring entry point ---------------------------------------------------------------------------------------------

def score_main(args) -> int:
    """``--score``: one reward per text on stdout (``%.6f``, input order); everything else goes to stderr.
    Scores are computed in fp32 unless ``--mixed_precision`` asks for bf16 or fp16 (autocast), so that by default
    a score does not depend on the machine."""
    prompts, responses = texts_to_score(args)  # a bad text file fails before the model loads
    model, tokenizer, _ = load_checkpoint(args.checkpoint, "reward", flag="--checkpoint")
    speed_up(model)  # the same model, its small products fast (gpt_fast.py)
    if args.max_length and args.max_length > model.cfg.context_length:
        raise UserError(f"--max_length {args.max_length} is longer than the model's context_length "
                        f"{model.cfg.context_length}; lower it")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    started = time.time()
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        scores = score_texts(model, tokenizer, prompts, responses, args.batch_size or 32, args.max_length)
    for s in scores:
        print(f"{s:.6f}")
    print(f"scored {len(scores)} text(s) with {args.checkpoint} in {time.time() - started:.1f} s "
          f"({args.mixed_precision if autocast else 'fp32'})", file=sys.stderr)
    return 0


# --- training --------------------------------------------------------------------------------------------------------

class Pairwise:
    """The pairwise objective (the default): (chosen, rejected) pairs, both sides in one forward pass, the
    Bradley–Terry ``pairwise_loss``; a pair counts as right when the chosen side scores higher."""

    what = "pairs"

    @staticmethod
    def examples(args, encode):
        """(chosen ids, rejected ids) per pair, the number of pairs cut to --max_length, each pair's longer side."""
        encoded = [(encode(p, c), encode(p, r)) for p, c, r in read_preference_pairs(args.train_files, "--train_files")]
        train = [(chosen, rejected) for (chosen, _), (rejected, _) in encoded]
        cut = sum(chosen_cut or rejected_cut for (_, chosen_cut), (_, rejected_cut) in encoded)
        return train, cut, [max(len(chosen), len(rejected)) for chosen, rejected in train]

    @staticmethod
    def collate(items) -> dict:
        """Chosen rows then rejected rows: one right-padded (2b, T) batch."""
        return pad_right([c for c, _ in items] + [r for _, r in items])

    @staticmethod
    def loss_and_accuracy(rewards, batch):
        r_chosen, r_rejected = rewards.chunk(2)  # (b,), (b,): the collate put chosen rows first
        return pairwise_loss(r_chosen, r_rejected), pairs_ranked_right(r_chosen, r_rejected) / len(r_chosen)


class Pointwise:
    """The pointwise objective (``--objective pointwise``): texts labelled good (1) or bad (0), ``pointwise_loss``;
    a text counts as right when the sign of its reward is its label."""

    what = "texts"

    @staticmethod
    def examples(args, encode):
        """(ids, label) per text, the number cut to --max_length, each one's length."""
        encoded = [(encode(p, t), label) for p, t, label in read_labelled(args.train_files, "--train_files")]
        train = [(ids, label) for (ids, _), label in encoded]
        return train, sum(cut for (_, cut), _ in encoded), [len(ids) for ids, _ in train]

    @staticmethod
    def collate(items) -> dict:
        """One right-padded (b, T) batch and its (b,) labels."""
        return {**pad_right([ids for ids, _ in items]), "labels": torch.tensor([label for _, label in items])}

    @staticmethod
    def loss_and_accuracy(rewards, batch):
        return pointwise_loss(rewards, batch["labels"]), ((rewards > 0).float() == batch["labels"]).float().mean()


OBJECTIVES = {"pairwise": Pairwise, "pointwise": Pointwise}


def build_model(args, tokenizer):
    """A ``RewardModel`` whose backbone holds the --init weights (its head is new); returns (model, parent meta)."""
    backbone, parent = load_backbone(args.init, "--init", tokenizer, "1-SFT.py", kind="backbone")
    model = RewardModel(backbone.cfg)
    model.backbone.load_state_dict(backbone.state_dict())
    return model, parent


def evaluate_pairs(model, pairs, tokenizer, args, accelerator) -> dict:
    """Loss, accuracy and mean margin over ``pairs``; each process scores its share, the scores are gathered."""
    from accelerate.utils import gather_object

    mine = pairs[accelerator.process_index::accelerator.num_processes]
    prompts = [p for p, _, _ in mine]
    unwrapped = accelerator.unwrap_model(model)
    chosen = score_texts(unwrapped, tokenizer, prompts, [c for _, c, _ in mine], 2 * args.batch_size, args.max_length)
    rejected = score_texts(unwrapped, tokenizer, prompts, [r for _, _, r in mine], 2 * args.batch_size,
                           args.max_length)
    if accelerator.num_processes > 1:  # every process gathers in the same order, so the pairs stay aligned
        chosen, rejected = gather_object(chosen), gather_object(rejected)
    return pair_metrics(chosen, rejected)


def make_rm_optimizer(model, args):
    """The optimizer of the reward model: the backbone's groups (``optimizers.make_optimizer``, the embedding at
    ``--embedding_lr_scale`` times the rate) and the new scalar head in a group of its own at ``--head_lr_scale``
    times the rate and without weight decay."""
    optimizer = make_optimizer(model.backbone, args.learning_rate, args.weight_decay,
                               embedding_lr_scale=args.embedding_lr_scale)
    # the head is new: a larger step lets it grow to a useful scale while the pretrained backbone moves gently
    optimizer.add_param_group({"params": list(model.head.parameters()), "weight_decay": 0.0,
                               "lr_scale": args.head_lr_scale})
    return optimizer


def main(argv=None):
    args = parse_args(argv)
    if args.score:
        return score_main(args)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- model: the parent's GPT + a new scalar head ----------------------------------------------------------------
    model, parent = build_model(args, tokenizer)
    speed_up(model)  # the same model, its decoding paths fast (gpt_fast.py)
    if not 4 <= args.max_length <= model.cfg.context_length:
        raise UserError(f"--max_length {args.max_length} must be in 4..{model.cfg.context_length} (the model's "
                        f"context)")

    # --- data: each side through the chat template, [CLS] prompt [ANS] response [SEP] ------------------------------
    def encode(prompt, response):  # -> (input_ids, whether it was cut to --max_length)
        input_ids, _, truncated = apply_chat_template(prompt, response, tokenizer, args.max_length)
        return input_ids, truncated

    objective = OBJECTIVES[args.objective]
    train, truncated, lengths = objective.examples(args, encode)
    val = read_preference_pairs(args.val_files, "--val_files")
    val = [val[i] for i in spread_subset(len(val), args.eval_examples)]  # a fixed subset keeps evaluations short
    test_files = expand_files(args.test_files, "--test_files")  # fail now, not after training
    # Reviews run from 10 to 130 tokens: batches of similar lengths waste little compute on padding, and the
    # schedule shuffles whole batches (so the order is still a pure function of (seed, step) and --resume is exact).
    batches = length_grouped_batches(lengths, args.batch_size)
    schedule = BatchSchedule(len(batches), 1, args.gradient_accumulation_steps, accelerator.num_processes, args.seed)
    accelerator.print(f"train: {len(train)} {objective.what} ({truncated} cut to {args.max_length} tokens); val: "
                      f"{len(val)} pairs; {sum(p.numel() for p in model.parameters()):,} parameters; "
                      f"global batch {args.batch_size * schedule.global_batch_size}")

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -------------------------
    optimizer = make_rm_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    stage = StageRun("rm", args, accelerator, model, optimizer, tokenizer,
                     {**parent, "objective": args.objective, "max_length": args.max_length},
                     plot=("loss_curve.png", ["train_loss", "val_loss", "val_accuracy", "val_margin"]))

    # --- the loop ----------------------------------------------------------------------------------------------------
    model.train()
    for step in stage.steps():
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))  # warm-up, cosine
        step_loss, step_accuracy, tokens = 0.0, 0.0, 0
        for micro in range(args.gradient_accumulation_steps):
            items = [train[i] for i in batches[schedule.indices(step, micro, accelerator.process_index)[0]]]
            batch = {k: v.to(accelerator.device) for k, v in objective.collate(items).items()}
            with stage.accumulate():
                rewards = model(batch["input_ids"], batch["attention_mask"])["rewards"]  # (2b,) or (b,)
                loss, correct = objective.loss_and_accuracy(rewards, batch)
                accelerator.backward(loss)  # divided by the micro-batches; gradients sync on the last one
            step_loss += loss.item() / args.gradient_accumulation_steps
            step_accuracy += correct.item() / args.gradient_accumulation_steps
            tokens += int(batch["attention_mask"].sum())
        if stage.clip_gradients():  # to --max_grad_norm; False: a non-finite gradient, never applied
            optimizer.step()
        optimizer.zero_grad()
        row = {"train_loss": stage.end_step(step_loss, tokens), "train_accuracy": step_accuracy}
        if stage.eval_due:
            result = evaluate_pairs(model, val, tokenizer, args, accelerator)
            row.update({f"val_{k}": v for k, v in result.items()})
            stage.print(f"step {stage.step}: val loss {result['loss']:.3f}, accuracy {result['accuracy']:.1%}, "
                        f"margin {result['margin']:.2f}")
        stage.log(row, show=("train_loss", "train_accuracy", "lr"))
    if not stage.completed:
        return stage.finish()
    stage.save_before_final_evaluation()  # a Ctrl-C below keeps the trained steps; --resume runs only what follows

    # --- test: pairs no stage has seen ------------------------------------------------------------------------------
    result = evaluate_pairs(model, read_preference_pairs(test_files, "--test_files"), tokenizer, args, accelerator)
    stage.metrics.add(step=stage.step, **{f"test_{k}": v for k, v in result.items()})
    stage.results.update({f"test_{k}": round(v, 6) for k, v in result.items()})
    return stage.finish(f"test loss {result['loss']:.3f}, accuracy {result['accuracy']:.1%}, "
                        f"margin {result['margin']:.2f}")


if __name__ == "__main__":
    run(main)
