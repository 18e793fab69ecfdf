"""Stage 3 (DPO) — align the SFT model straight on preference pairs, with no reward model in the loop.

Direct Preference Optimization (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is
Secretly a Reward Model"): the KL-regularised RLHF objective max E[r] - beta KL(pi || pi_ref) has the closed-form
optimum pi*(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta), so r(x, y) = beta log(pi*(y|x) / pi_ref(y|x)) + beta log Z(x).
Put that implicit reward into the Bradley–Terry loss the RM uses and Z(x) cancels between the two answers:

    loss = -log sigmoid(beta * [(log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x))])

Story of the stage: arguments → preference pairs (the RM's train/val split; the test split stays unseen) through
the one chat template (both answers of a pair on the same prompt ids) → the policy and a frozen reference, both
from SFT → the loop (response-only log-probs of chosen and rejected answers, dropout off in both models so that
step 0 is exactly log 2, the DPO loss, AdamW through Accelerate; implicit-reward accuracy and margin on val
every ``--eval_every`` steps) → the held-out monitors of SFT and DPO side by side, measured as PPO and GRPO
measure theirs (the RM, which DPO never trains on, scores sampled answers; the independent judge, KL, length,
[SEP] share, repetition) → checkpoint (a GPT, like SFT's, that ``generate.py`` reads).

    python 3-DPO.py                 # demo preset: checkpoints/sft + data/rm -> checkpoints/dpo
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chinese_tokenizer import SEP_ID, chat_prompt_ids, encode, load_tokenizer
from gpt_fast import speed_up
from plumbing.alignment import PROMPT_FILES, add_held_out_arguments, load_policy_and_reward, read_val_prompts
from plumbing.batching import BatchSchedule, chat_example, collate_chat, length_grouped_batches, spread_subset
from plumbing.checkpoint import check_output_dir
from plumbing.cli import (
    UserError,
    add_lora_arguments,
    check_lora_arguments,
    default_path,
    fill_defaults,
    positive_float,
    positive_int,
    run,
    stage_parser,
)
from plumbing.held_out import PREFERENCES, HeldOut
from plumbing.judge import SentimentJudge
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.records import read_preference_pairs
from plumbing.reward import pairs_ranked_right
from plumbing.rollouts import sequence_logprobs
from plumbing.training import StageRun, make_accelerator

# Run length and optimisation per preset; every value can be overridden on the command line. The model comes from
# --policy, so the preset only sets how long and how fast to train, and beta.
DEFAULTS = {
    "tiny": dict(max_steps=10, batch_size=4, learning_rate=1e-4, warmup_steps=2, eval_every=5, eval_examples=8,
                 max_length=64, max_new_tokens=16, eval_samples=2, beta=0.1),
    # beta and steps: bench/README.md, "The demo recipes" (sweep_align.py --stage dpo); 96 of the 286 val pairs
    "demo": dict(max_steps=60, batch_size=8, learning_rate=1e-4, warmup_steps=10, eval_every=60,
                 eval_examples=96, max_length=128, max_new_tokens=40, eval_samples=4, beta=1.0),
    "gpt2-zh-small": dict(max_steps=1000, batch_size=16, learning_rate=1e-6, warmup_steps=50, eval_every=200,
                          eval_examples=1000, max_length=256, save_every=200, max_new_tokens=64, eval_samples=2,
                          beta=0.1),
    "uer-gpt2-chinese": dict(max_steps=1000, batch_size=16, learning_rate=5e-7, warmup_steps=50, eval_every=200,
                             eval_examples=1000, max_length=256, save_every=200, max_new_tokens=64, eval_samples=2,
                             beta=0.1),
}


def parse_args(argv=None):
    p = stage_parser("Stage 3 (DPO): Direct Preference Optimization of the SFT model on preference pairs.",
                     default_path("checkpoints", "dpo"), DEFAULTS)
    p.add_argument("--policy", default=default_path("checkpoints", "sft"),
                   help="SFT checkpoint: the policy to train and its frozen reference")
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "rm", "train.jsonl")],
                   help='.jsonl files or globs of {"prompt","chosen","rejected"} lines or chosen/rejected '
                        'conversations (the RM\'s training pairs)')
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "rm", "val.jsonl")],
                   help="preference pairs for the implicit-reward accuracy and margin during training")
    p.add_argument("--beta", type=positive_float,
                   help="strength of the KL tie to the reference: small lets the policy move far, large keeps it near "
                        "(default: the preset's)")
    p.add_argument("--loss", default="sigmoid", choices=["sigmoid", "ipo"],
                   help="sigmoid: DPO's -log sigmoid(beta * margin); ipo: (margin - 1/(2 beta))^2 (Azar et al. 2023)")
    p.add_argument("--max_length", type=positive_int,
                   help="longest sequence in tokens; a longer pair loses the start of its prompt, then the end of "
                        "its response")
    add_held_out_arguments(p, "DPO")
    add_lora_arguments(p)
    args = p.parse_args(argv)
    check_lora_arguments(args)
    return fill_defaults(args, {**DEFAULTS[args.preset], "val_prompts_file": PROMPT_FILES[False]["val_prompts_file"]})


# --- the maths of DPO ------------------------------------------------------------------------------------------

def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, loss_type: str = "sigmoid"):
    """The DPO loss of a batch of pairs and each answer's implicit reward.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: (b,) sequence log-probs of the chosen and
            rejected responses under the policy and the frozen reference (``rollouts.sequence_logprobs``).
        beta: the KL coefficient of the RLHF objective that DPO solves in closed form.
        loss_type: "sigmoid" (Rafailov et al. 2023) or "ipo" (Azar et al. 2023, which regresses the log-ratio
            margin to 1 / (2 beta) instead of pushing it to infinity).
    Returns:
        (loss scalar, chosen_rewards (b,), rejected_rewards (b,)); a reward is beta * log(pi / pi_ref), in nats.
    """
    chosen_rewards = beta * (policy_chosen - ref_chosen)  # (b,)
    rejected_rewards = beta * (policy_rejected - ref_rejected)  # (b,)
    margin = (chosen_rewards - rejected_rewards) / beta  # (b,) the log-ratio margin h
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}; choose sigmoid or ipo")
    return losses.mean(), chosen_rewards, rejected_rewards


def encode_pairs(pairs, tokenizer, max_length: int) -> tuple[list[tuple], int, int]:
    """Each (prompt, chosen, rejected) through the chat template: ((inputs, labels) chosen, (inputs, labels)
    rejected), response-only labels (see ``batching.chat_example``), both sides on the same prompt ids.

    A pair longer than ``max_length`` positions is cut once for both sides: the prompt loses its start (or its
    oldest turns, ``chat_prompt_ids``) until the longer response fits, the same prompt ids on either side, and only
    then does a response that alone is too long lose its end. The DPO margin compares log pi(chosen | x) with
    log pi(rejected | x): both must condition on the same x. A pair that cannot keep a response token on both sides
    is dropped.

    Returns:
        (encoded pairs, the number of pairs that were cut, the number that were dropped).
    """
    limit = max_length + 1  # ids per side: the model reads all but the last (chat_example shifts by one)
    encoded, cut, dropped = [], 0, 0
    for prompt, chosen, rejected in pairs:
        answers = [encode(answer, tokenizer) + [SEP_ID] for answer in (chosen, rejected)]
        whole = chat_prompt_ids(prompt, tokenizer)  # [CLS] prompt [ANS]
        longest = max(map(len, answers))
        prompt_ids = whole if len(whole) + longest <= limit else chat_prompt_ids(prompt, tokenizer,
                                                                                max(3, limit - longest))
        room = limit - len(prompt_ids)  # what each response may keep
        if room < 1:
            dropped += 1
            continue
        cut += len(prompt_ids) < len(whole) or longest > room
        encoded.append(tuple(chat_example(prompt_ids + answer[:room], [0] * len(prompt_ids) + [1] * len(answer[:room]))
                             for answer in answers))
    return encoded, cut, dropped


def read_pairs(args, tokenizer, print_=print) -> tuple[list[tuple], list[tuple], list[list[int]]]:
    """The encoded training pairs, ``--eval_examples`` encoded val pairs, and the training pairs' batches of similar
    length (``length_grouped_batches``); prints how many pairs were cut or dropped.

    Raises:
        UserError: a preference file is missing or malformed (``read_preference_pairs``).
    """
    train, cut, dropped = encode_pairs(read_preference_pairs(args.train_files, "--train_files"), tokenizer,
                                       args.max_length)
    if dropped:
        print_(f"warning: dropped {dropped} training pair(s) that keep no response token within "
               f"--max_length {args.max_length}; raise --max_length or shorten their prompts")
    val_pairs = read_preference_pairs(args.val_files, "--val_files")
    val, _, _ = encode_pairs([val_pairs[i] for i in spread_subset(len(val_pairs), args.eval_examples)], tokenizer,
                             args.max_length)
    batches = length_grouped_batches([max(len(c[0]), len(r[0])) for c, r in train], args.batch_size)
    print_(f"train: {len(train)} pairs ({cut} cut to {args.max_length} tokens), {len(batches)} batches "
           f"of <= {args.batch_size}; val: {len(val)} pairs; beta {args.beta}, {args.loss} loss")
    return train, val, batches


def collate_pairs(items) -> dict:
    """Pairs -> one right-padded (2b, T) batch: the b chosen sequences first, then the b rejected ones."""
    return collate_chat([chosen for chosen, _ in items] + [rejected for _, rejected in items])


def pair_logprobs(model, batch):
    """(chosen, rejected) response log-probs, each (b,), of a ``collate_pairs`` batch under ``model``."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]  # (2b, T, V)
    return sequence_logprobs(logits, batch["labels"]).chunk(2)  # (b,), (b,)


@torch.no_grad()
def evaluate(policy, ref, items, args, accelerator) -> dict:
    """Mean loss, implicit-reward accuracy (chosen reward > rejected reward, a tie half: ``reward.pairs_ranked_right``)
    and margin over ``items``, each process taking every ``num_processes``-th pair."""
    was_training = policy.training
    policy.eval()
    totals = torch.zeros(4, device=accelerator.device, dtype=torch.float64)  # loss sum, correct, margin sum, count
    mine = items[accelerator.process_index::accelerator.num_processes]
    for start in range(0, len(mine), args.batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate_pairs(mine[start:start + args.batch_size]).items()}
        with accelerator.autocast():
            loss, chosen, rejected = dpo_loss(*pair_logprobs(policy, batch), *pair_logprobs(ref, batch), args.beta,
                                              args.loss)
        totals += torch.stack([loss * len(chosen), pairs_ranked_right(chosen, rejected), (chosen - rejected).sum(),
                               torch.tensor(len(chosen), device=chosen.device)]).to(totals)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    policy.train(was_training)
    loss_sum, correct, margin_sum, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count, "margin": margin_sum / count}


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- models: the policy and its frozen reference, both the SFT model; the RM only scores held-out answers ------
    policy, parent, ref, reward_model, context_length = load_policy_and_reward(args, tokenizer, accelerator.device)
    speed_up(policy, ref, reward_model)  # the same models, their loss and decoding paths fast (gpt_fast.py)
    if not 4 <= args.max_length <= policy.cfg.context_length:
        raise UserError(f"--max_length {args.max_length} must be in 4..{policy.cfg.context_length} (the model's "
                        f"context)")

    # --- data: preference pairs through the chat template, [CLS] prompt [ANS] answer [SEP] ------------------------
    train, val, batches = read_pairs(args, tokenizer, accelerator.print)
    schedule = BatchSchedule(len(batches), 1, args.gradient_accumulation_steps, accelerator.num_processes, args.seed)

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -------------------
    optimizer = make_optimizer(policy, args.learning_rate, args.weight_decay)
    model, optimizer = accelerator.prepare(policy, optimizer)  # model: Accelerate's wrapper, what trains
    policy = accelerator.unwrap_model(model, keep_torch_compile=False)  # the plain GPTModel: samples, is saved
    stage = StageRun("dpo", args, accelerator, model, optimizer, tokenizer,
                     {**parent, "beta": args.beta, "loss": args.loss},
                     plot=("curves.png", ["train_loss", "val_loss", "val_accuracy", "val_margin"]),
                     other_models=(ref, reward_model))

    # the monitors PPO and GRPO report, on the same held-out prompts and draws: what DPO did to the answers
    held_out = HeldOut(stage, policy, ref, read_val_prompts(args), tokenizer, args, context_length, PREFERENCES,
                       reward_model=reward_model, judge=SentimentJudge())

    def evaluate_and_print() -> dict:
        result = {f"val_{k}": v for k, v in evaluate(model, ref, val, args, accelerator).items()}
        stage.print(f"step {stage.step}: val loss {result['val_loss']:.3f}, implicit-reward accuracy "
                    f"{result['val_accuracy']:.1%}, margin {result['val_margin']:.3f}")
        return result

    # --- the loop ------------------------------------------------------------------------------------------------
    # step 0, the SFT model itself: policy == reference, so loss log 2, margin 0, every pair a tie (accuracy 50%)
    sft = held_out.before(first_row=evaluate_and_print)
    # dropout off in both forwards, as TRL and the DPO authors' code do: the policy's log-probs are then a function
    # of its weights alone, so step 0 (policy == reference) gives exactly log 2 and implicit rewards 0
    model.eval()
    for step in stage.steps():
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))  # warm-up, cosine
        step_loss, step_accuracy, tokens = 0.0, 0.0, 0
        for micro in range(args.gradient_accumulation_steps):
            items = [train[i] for i in batches[schedule.indices(step, micro, accelerator.process_index)[0]]]
            batch = {k: v.to(accelerator.device) for k, v in collate_pairs(items).items()}
            with torch.no_grad(), accelerator.autocast():
                ref_chosen, ref_rejected = pair_logprobs(ref, batch)  # (b,), (b,)
            with stage.accumulate():
                loss, chosen, rejected = dpo_loss(*pair_logprobs(model, batch), ref_chosen, ref_rejected,
                                                  args.beta, args.loss)
                accelerator.backward(loss)  # divided by the micro-batches; gradients sync on the last one
            step_loss += loss.item() / args.gradient_accumulation_steps
            right = pairs_ranked_right(chosen, rejected).item() / len(chosen)
            step_accuracy += right / args.gradient_accumulation_steps
            tokens += int(batch["attention_mask"].sum())
        if stage.clip_gradients():  # to --max_grad_norm; False: a non-finite gradient, never applied
            optimizer.step()
        optimizer.zero_grad()
        row = {"train_loss": stage.end_step(step_loss, tokens), "train_accuracy": step_accuracy}
        if stage.eval_due:
            row.update(evaluate_and_print())
        stage.log(row, show=("train_loss", "train_accuracy", "lr"))
    if not stage.completed:
        return stage.finish()
    stage.save_before_final_evaluation()  # a Ctrl-C below keeps the trained steps; --resume runs only what follows

    # --- SFT and DPO on the held-out prompts, and the reward-hacking flag ------------------------------------------
    dpo = held_out.after("dpo", sft)
    first, last = stage.metrics.rows[0], stage.latest_val()
    return stage.finish(f"val implicit-reward accuracy {first['val_accuracy']:.1%} -> {last['val_accuracy']:.1%}, "
                        f"margin {last['val_margin']:.3f}; held-out judge {sft['judge']:.3f} (SFT) -> "
                        f"{dpo['judge']:.3f} (DPO), KL {dpo['kl']:.2f} nats/response")


if __name__ == "__main__":
    run(main)
