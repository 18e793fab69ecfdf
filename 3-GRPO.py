"""Stage 3 (GRPO) — align the SFT model against the reward model with group-relative advantages and no critic.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", section 4.1): for each prompt sample a
group of G responses, score each with the RM, and use each response's score relative to its group,
A_i = (r_i - mean(r)) / std(r), as the advantage of every one of its tokens. The group mean replaces PPO's learned
value function as the baseline, so there is no critic to train. The loss is PPO's clipped surrogate with that
advantage plus ``beta`` times a per-token KL estimate to the frozen reference (the "k3" estimator, which is never
negative), averaged over each response's tokens and then over responses.

With ``--verifier`` the reward is a program's 1 or 0 (RLVR); on the review instructions the RM's score (negated on
a 差评) counts beside it, weighted by ``--rm_weight`` (``term_advantages``), so that the constraint is not kept by
writing worse reviews.

Story of the stage: arguments → prompts → the policy and a frozen reference from SFT, the rewards → the loop, each
iteration (1) sample G responses per prompt with the KV-cached ``generate``, (2) score them, (3) group
advantages, (4) ``--grpo_epochs`` passes of the clipped objective (``grpo_update``), (5) log → the held-out
monitors of SFT and GRPO side by side (RM score, the independent judge, KL, length, [SEP] share, repetition;
``judge.py``; or exact accuracy with ``--verifier``) and the reward-hacking flag → checkpoint (a GPT).

    python 3-GRPO.py                # demo preset: checkpoints/sft + checkpoints/rm -> checkpoints/grpo
"""

from __future__ import annotations

import torch

from chinese_tokenizer import load_tokenizer
from gpt_fast import speed_up
from plumbing.alignment import Online, add_online_arguments, online_defaults
from plumbing.batching import BatchSchedule
from plumbing.checkpoint import check_output_dir
from plumbing.cli import (
    UserError,
    check_lora_arguments,
    default_path,
    non_negative_float,
    positive_int,
    run,
    stage_parser,
)
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.rollouts import masked_mean, response_logits, token_logprobs
from plumbing.training import StageRun, make_accelerator

# max_steps = iterations; rollout_size = prompts per iteration (each answered group_size times); batch_size =
# sequences per update minibatch; eval_samples = samples per held-out prompt; a preset without a row of its own
# takes that of the preset of its size (cli.SAME_SIZE)
DEFAULTS = {
    "tiny": dict(max_steps=4, rollout_size=4, group_size=4, batch_size=8, learning_rate=1e-4, warmup_steps=0,
                 eval_every=2, eval_examples=8, max_new_tokens=16, eval_samples=2, kl_coef=0.04),
    # lr and KL weight: bench/README.md, "The demo recipes" (sweep_align.py --stage grpo)
    "demo": dict(max_steps=20, rollout_size=4, group_size=8, batch_size=16, learning_rate=3e-5, warmup_steps=2,
                 eval_every=20, eval_examples=48, max_new_tokens=40, eval_samples=4, kl_coef=0.4),
    "gpt2-zh-small": dict(max_steps=400, rollout_size=16, group_size=8, batch_size=32, learning_rate=1e-6,
                          warmup_steps=10, eval_every=50, eval_examples=200, max_new_tokens=64, eval_samples=2,
                          save_every=50, kl_coef=0.04),
}
# --verifier: answers of up to 64 tokens (a limit is at most 60 characters, a token at least one); eval_examples = the
# whole test split
TASK_DEFAULTS = {
    "tiny": dict(max_steps=4, rollout_size=4, group_size=4, batch_size=16, learning_rate=1e-4, warmup_steps=0,
                 eval_every=4, eval_examples=8, max_new_tokens=8, eval_samples=2, kl_coef=0.04, rm_weight=0.2),
    # iterations, prompts and lr: bench/README.md, "RL teaches the review instructions" and "The pipeline's wall time";
    # KL weight and rm_weight: "Keeping the reviews"
    "demo": dict(max_steps=20, rollout_size=16, group_size=8, batch_size=64, learning_rate=1e-4, warmup_steps=2,
                 eval_every=20, eval_examples=500, max_new_tokens=64, eval_samples=2, kl_coef=0.1, rm_weight=0.2),
    "gpt2-zh-small": dict(max_steps=200, rollout_size=32, group_size=8, batch_size=64, learning_rate=1e-6,
                          warmup_steps=10, eval_every=50, eval_examples=500, max_new_tokens=64, eval_samples=4,
                          save_every=50, kl_coef=0.04, rm_weight=0.2),
}


def parse_args(argv=None):
    p = stage_parser("Stage 3 (GRPO): Group Relative Policy Optimization of the SFT model against the reward model, "
                     "or on verifiable tasks (--verifier).",
                     None, {**DEFAULTS, **{f"{k} with --verifier": v for k, v in TASK_DEFAULTS.items()}},
                     steps="GRPO iterations (--rollout_size prompts answered --group_size times each, then the "
                           "updates on them)",
                     examples="held-out prompts (the first of --val_prompts_file)")
    add_online_arguments(p, "GRPO")
    p.add_argument("--group_size", type=positive_int, help="G, responses sampled per prompt (at least 2)")
    p.add_argument("--grpo_epochs", type=positive_int, default=1,
                   help="passes over each iteration's samples; even with 1 the ratio is 1 only in the first minibatch "
                        "(the later ones were sampled before the earlier updates), so the clip can act")
    p.add_argument("--rm_weight", type=non_negative_float,
                   help="with --verifier: the weight at which the reward model's (--reward) score of the answers "
                        "to review instructions (negated on a 差评) adds its own advantage (relative to the group, "
                        "in units of the batch's spread: term_advantages) to the verifier's, so that a constraint "
                        "is not kept by writing worse reviews; 0: the verifier alone (default: the preset's)")
    args = p.parse_args(argv)
    check_lora_arguments(args)
    online_defaults(args, DEFAULTS, TASK_DEFAULTS, {False: default_path("checkpoints", "grpo"),
                                                    True: default_path("checkpoints", "grpo-tasks")})
    if args.rm_weight and not args.verifier:
        raise UserError(f"--rm_weight {args.rm_weight} weighs the reward model beside a verifier, but without "
                        f"--verifier the reward is the reward model's alone; drop --rm_weight or add --verifier exact")
    if args.group_size < 2:
        raise UserError(f"--group_size {args.group_size}: a group needs at least 2 responses to compare; "
                        f"give 2 or more")
    return args


# --- the maths of GRPO, one function each ---------------------------------------------------------------------

# Below this spread (a standard deviation of the rewards, in float64) a group's responses count as scored alike: fp32
# rounding alone makes eight equal RM scores of 0.35 differ by about 1e-8, which dividing by their spread would turn
# into advantages of +-0.03; a verifier's all-right and all-wrong groups are alike exactly.
FLAT_GROUP_STD = 1e-6


def group_advantages(scores, group_size: int):
    """Group-relative advantages (Shao et al. 2024, section 4.1.2): each response's score minus the mean of its
    group, over the group's standard deviation (unbiased), computed in float64. The G responses to one prompt are
    G consecutive rows.

    A group whose standard deviation is below ``FLAT_GROUP_STD`` (every response scored alike, up to rounding) has
    nothing to teach: its advantages are exactly 0, not rounding noise divided by a tiny spread.

    Returns:
        (advantages (B,) float32 with B = n * G, flat (n,) bool: the groups scored alike).
    """
    grouped = scores.double().view(-1, group_size)  # (n, G)
    mean = grouped.mean(dim=1, keepdim=True)  # (n, 1)
    std = grouped.std(dim=1, keepdim=True)  # (n, 1)
    flat = std < FLAT_GROUP_STD  # (n, 1)
    advantages = torch.where(flat, 0.0, (grouped - mean) / torch.where(flat, 1.0, std))  # (n, G)
    return advantages.view(-1).float(), flat.view(-1)


def term_advantages(scores, group_size: int):
    """The advantages of a further, graded reward beside the first (``--rm_weight``: the RM's score of the reviews
    beside the verifier's 1 or 0): each scored response's score minus the mean of its group, over the standard
    deviation of those differences across all the scored responses of the batch, in float64; 0 where the reward
    does not apply (NaN), and everywhere when fewer than two are scored or their differences are all 0.

    Why the batch's spread and not the group's: where every answer of a group kept the constraint (a flat group for
    the verifier), the group's own spread would turn its small RM differences into advantages as large as the
    verifier's, and the weight would no longer say how much the RM counts. Rewards kept apart and normalised each
    on its own before a weighted sum, rather than summed first, for the same reason: the RM's scale is not the
    verifier's. The G responses to one prompt are G consecutive rows, all scored or none.

    Args:
        scores: (B,) the reward, NaN on the rows it does not apply to.
    Returns:
        (B,) float32.
    """
    scored = ~torch.isnan(scores)  # (B,)
    grouped = torch.where(scored, scores, 0.0).double().view(-1, group_size)  # (n, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (B,)
    spread = centred[scored].std() if int(scored.sum()) > 1 else torch.zeros((), dtype=torch.float64)
    if not spread > FLAT_GROUP_STD:
        return torch.zeros_like(scores, dtype=torch.float32)
    return torch.where(scored, centred / spread, 0.0).float()


def grpo_advantages(rewards, weights, ended, args):
    """Each response's advantage from its rewards: the first reward (the RM's score or the verifier's), less
    ``--no_eos_penalty`` where the answer never ended, relative to its group (``group_advantages``), plus each
    further reward's ``term_advantages`` times its weight.

    Args:
        rewards: (B, K) from ``Online.score``; weights: (K,); ended: (B,) bool, the answer ended with [SEP].
    Returns:
        (advantages (B,) float32, flat (n,) bool: the groups the first reward scored alike).
    """
    first = rewards[:, 0] - args.no_eos_penalty * (~ended).float()  # (B,) an answer cut off is not an answer
    advantages, flat = group_advantages(first, args.group_size)  # (B,), (n,)
    for k in range(1, rewards.shape[1]):
        advantages = advantages + weights[k] * term_advantages(rewards[:, k], args.group_size)
    return advantages, flat


def kl_k3(logprobs, ref_logprobs):
    """Per-token estimate of KL(pi || pi_ref) at tokens sampled from pi, the one GRPO uses (Schulman 2020,
    "Approximating KL divergence", k3): ``exp(ref - logp) - (ref - logp) - 1``. Unbiased, and never negative
    (x - 1 - log x >= 0 for x = pi_ref / pi), so every token's term pulls towards the reference. (B, R) -> (B, R)."""
    log_ratio = ref_logprobs - logprobs  # log(pi_ref / pi)
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cliprange: float, beta: float):
    """The GRPO objective, negated to be minimised (Shao et al. 2024, eq. 3): per token the clipped surrogate with
    the response's group advantage, minus ``beta`` times the k3 KL to the reference; averaged over each response's
    real tokens, then over responses.

    Padded positions are set aside with a select before any ``exp`` (``torch.where``, not a multiplication by the
    mask): a padded log-prob far from the reference's would overflow ``exp``, and ``inf * 0`` is NaN, in the loss
    and in every gradient.

    Args:
        logprobs: (B, R) log pi of the sampled tokens under the policy being updated (with gradient).
        old_logprobs, ref_logprobs: (B, R) the same under the sampling policy and the frozen reference.
        advantages: (B,) from ``group_advantages``; mask: (B, R) 1 on real response tokens, else 0.
    Returns:
        (loss, clip_fraction, kl): the scalar loss; the share of real tokens where the clip bounds the objective
        (the clipped term is the smaller one, as PPO's ``clip_fraction`` counts: a ratio beyond 1 + eps with a
        negative advantage is not clipped, the objective follows it); the mean k3 estimate per token.
    """
    real = mask.bool()
    ratio = torch.exp(torch.where(real, logprobs - old_logprobs, 0.0))  # (B, R) pi / pi_old, 1 on padding
    a = advantages[:, None]  # (B, 1): one advantage for every token of the response
    unclipped, clipped = ratio * a, ratio.clamp(1 - cliprange, 1 + cliprange) * a  # (B, R)
    surrogate = torch.minimum(unclipped, clipped)  # (B, R)
    kl = kl_k3(torch.where(real, logprobs, 0.0), torch.where(real, ref_logprobs, 0.0))  # (B, R), 0 on padding
    per_token = torch.where(real, -(surrogate - beta * kl), 0.0)  # (B, R)
    loss = (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    return loss, masked_mean((clipped < unclipped).float(), mask), masked_mean(kl, mask)


def grpo_update(model, optimizer, stage, data, advantages, args) -> dict:
    """The update phase of one iteration: ``--grpo_epochs`` passes over the rollout ``data`` in shuffled minibatches
    of ``--batch_size``, each one gradient step on ``grpo_loss`` of ``model`` (Accelerate's wrapper of the policy).
    Returns the mean over the minibatches of ``loss``, ``clip_fraction`` and ``kl_k3_per_token``."""
    mask, P, n = data["response_mask"], data["prompt_len"], len(data["input_ids"])
    stats = []  # one row per minibatch: loss, clip fraction, KL
    for _ in range(args.grpo_epochs):
        order = torch.randperm(n)
        for start in range(0, n, args.batch_size):
            idx = order[start:start + args.batch_size].to(data["input_ids"].device)
            with stage.accumulate():
                # each prompt of the minibatch read once, its answers attending to its keys and values
                logits = response_logits(model, data["input_ids"][idx], data["attention_mask"][idx], P,
                                         prompt_of=idx // args.group_size)  # (b, R, V)
                logprobs = token_logprobs(logits, data["input_ids"][idx, P:])  # (b, R)
                loss, clip_fraction, kl = grpo_loss(logprobs, data["logprobs"][idx], data["ref_logprobs"][idx],
                                                    advantages[idx], mask[idx], args.cliprange, args.kl_coef)
                stage.accelerator.backward(loss)
            if stage.clip_gradients():  # to --max_grad_norm; False: a non-finite gradient, never applied
                optimizer.step()
            optimizer.zero_grad()
            stats.append(torch.stack([loss, clip_fraction, kl]).detach())
    return dict(zip(("loss", "clip_fraction", "kl_k3_per_token"), torch.stack(stats).mean(0).tolist()))


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- prompts to practise on, held-out ones to measure the change, the policy and a frozen reference from SFT,
    # and the rewards: the frozen RM's score, or a verifier's 1 or 0 (no critic either way) -------------------------
    online = Online(args, tokenizer, accelerator.device, rm_weight=args.rm_weight or 0.0)
    speed_up(online.policy, *online.scorers)  # the same models, their fast paths on (gpt_fast.py)
    prompts = online.prompts

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -------------------
    optimizer = make_optimizer(online.policy, args.learning_rate, args.weight_decay)
    model, optimizer = accelerator.prepare(online.policy, optimizer)  # model: Accelerate's wrapper, what trains
    model.eval()  # dropout off: sampling and updates see the same network, and KL is 0 before the first update
    policy = accelerator.unwrap_model(model, keep_torch_compile=False)  # the plain GPTModel: samples, is saved
    stage = StageRun("grpo", args, accelerator, model, optimizer, tokenizer,
                     {**online.parent, "group_size": args.group_size},
                     plot=("curves.png", [("score", "val_score"), ("judge", "val_judge"), ("kl", "val_kl"),
                                          ("length", "val_length"), ("eos_share", "val_eos_share"),
                                          ("distinct_2", "val_distinct_2"), "flat_groups", "clip_fraction",
                                          "train_loss"]),
                     other_models=online.scorers)
    held_out = online.held_out(stage, policy)
    sft = held_out.before()  # step 0 of the val_* curves: the SFT policy before any update

    # --- the loop: sample, score, advantages, update, log ------------------------------------------------------
    schedule = BatchSchedule(len(prompts), args.rollout_size, 1, accelerator.num_processes, args.seed)
    weights = online.weights  # (K,) the weight of each reward
    for step in stage.steps():
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))  # warm-up, cosine
        # 1. sample G answers to each prompt, with their log-probs under the policy and the reference
        batch_prompts = [prompts[i] for i in schedule.indices(step, 0, accelerator.process_index)]
        with accelerator.autocast():
            data = online.rollout(policy, batch_prompts, samples=args.group_size)
            # 2. score them: (B, K), one column per reward, NaN where one does not apply
            rewards = online.score(data)
        # 3. advantages relative to each group
        advantages, flat = grpo_advantages(rewards, weights, data["ended"], args)  # (B,), (n,)
        # 4. update: the clipped objective with the KL to the reference
        stats = grpo_update(model, optimizer, stage, data, advantages, args)
        # 5. log: the rollout's monitors, and the held-out ones every --eval_every iterations but the last (the
        # final measurement below is that one)
        row = {"train_loss": stage.end_step(stats.pop("loss"), tokens=int(data["attention_mask"].sum())),
               **online.rollout_row(data, rewards), **stats,
               "flat_groups": flat.float().mean().item()}  # the share of groups scored alike
        if (step + 1) % args.eval_every == 0 and step + 1 < args.max_steps:
            row.update(held_out.val_row(f"iteration {step + 1}"))
        stage.log(row, show=("score", "kl", "flat_groups"))
    if not stage.completed:
        return stage.finish()
    stage.save_before_final_evaluation()  # a Ctrl-C below keeps the trained steps; --resume runs only what follows

    # --- SFT and GRPO on the held-out prompts, and the reward-hacking flag -------------------------------------------
    return stage.finish(held_out.summary(sft, held_out.after("grpo", sft), "GRPO"))


if __name__ == "__main__":
    run(main)
