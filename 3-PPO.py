"""Stage 3 — RLHF with PPO: the policy learns to write what the reward model prefers, held near the SFT model.

Method: InstructGPT (Ouyang et al. 2022) and its predecessor (Ziegler et al. 2019, "Fine-Tuning Language Models
from Human Preferences"): each iteration

1. sample: responses to a batch of prompts with the KV-cached ``generate`` (dropout off), with the log-probs of
   the policy and of the frozen reference and the critic's values;
2. score: the frozen reward model scores ``[CLS] prompt [ANS] response [SEP]`` (or a verifier gives 1 or 0);
3. per-token rewards: ``-beta * (log pi(a_t) - log pi_ref(a_t))`` with the score added on the last real response
   token;
4. advantages: GAE (Schulman et al. 2016) over the response tokens from the critic's values, whitened over the
   real (non-padding) response tokens;
5. updates: several epochs of minibatch steps on the clipped policy objective (Schulman et al. 2017) plus the
   clipped value loss (``ppo_update``);
6. beta follows the rollout's KL to the reference (adaptive KL control), and the iteration is logged.

Against reward hacking (the policy pleasing the RM with text that is not better): the adaptive KL controller
has a target of a few nats per response and a horizon short enough to reach it within the run, a response that
runs to ``--max_new_tokens`` without ``[SEP]`` loses ``--no_eos_penalty`` from its score, the PPO epochs of an
iteration stop early once the policy has moved too far from the one that sampled (``--max_approx_kl``), and the
held-out evaluation reports, for the SFT and the PPO policy alike, the RM score beside an independent judge, the
KL to the reference, entropy, length, the share of answers that end and two repetition measures (``judge.py``),
with a plain "reward hacking suspected" sentence when they disagree.

Models: the policy and a frozen reference copy (both from the SFT checkpoint), the frozen reward model, and a
separate critic (a ``RewardModel`` initialised from the reward model, as InstructGPT does): a separate critic
keeps the value loss from pulling on the policy's features, and starting from the RM gives it a sensible value
scale from the first iteration. Dropout is off in every model throughout, so before the first update the policy
equals the reference exactly (KL = 0) and the PPO ratio is exactly 1.

    python 3-PPO.py                 # demo preset: checkpoints/sft + checkpoints/rm -> checkpoints/ppo
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from safetensors.torch import load_model, save_model

from chinese_tokenizer import load_tokenizer
from gpt_fast import speed_up
from gpt_model import RewardModel, last_real_index
from plumbing.alignment import Online, add_online_arguments, online_defaults
from plumbing.batching import BatchSchedule
from plumbing.checkpoint import check_output_dir
from plumbing.cli import (
    check_lora_arguments,
    default_path,
    non_negative_float,
    positive_float,
    positive_int,
    run,
    stage_parser,
    unit_interval,
)
from plumbing.judge import KL_LIMIT
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.rollouts import masked_mean, penalise_unfinished, token_logprobs
from plumbing.training import StageRun, make_accelerator, mean_over_processes

DEFAULT_TARGET_KL = KL_LIMIT  # nats per response: the KL controller's target, and the flag's budget when beta is fixed
# max_steps = PPO iterations; batch_size = sequences per update micro-batch; rollout_size = prompts per iteration;
# kl_horizon = samples over which the KL controller corrects beta; eval_samples = samples per held-out prompt; a
# preset without a row of its own takes that of the preset of its size (cli.SAME_SIZE)
DEFAULTS = {
    "tiny": dict(max_steps=4, rollout_size=8, batch_size=4, learning_rate=1e-4, warmup_steps=0, eval_every=2,
                 eval_examples=8, max_new_tokens=16, kl_horizon=32, eval_samples=2, kl_coef=0.05),
    # beta: bench/README.md, "The demo recipes" (sweep_align.py --stage ppo); held-out monitors before and after only
    "demo": dict(max_steps=20, rollout_size=16, batch_size=8, learning_rate=1e-4, warmup_steps=2, eval_every=20,
                 eval_examples=48, max_new_tokens=40, kl_horizon=64, eval_samples=4, kl_coef=2.0),
    "gpt2-zh-small": dict(max_steps=400, rollout_size=64, batch_size=16, learning_rate=1e-5, warmup_steps=10,
                          eval_every=50, eval_examples=200, max_new_tokens=64, save_every=50, kl_horizon=2560,
                          eval_samples=2, kl_coef=0.05),
}
# --verifier: the review instructions, rewards of 0 or 1 (answers of up to 64 tokens, the whole test split)
TASK_DEFAULTS = {
    "tiny": dict(max_steps=4, rollout_size=8, batch_size=8, learning_rate=1e-4, warmup_steps=0, eval_every=4,
                 eval_examples=8, max_new_tokens=8, kl_horizon=32, eval_samples=2, kl_coef=0.05),
    # iterations, lr, eval_samples: bench/README.md, "RL teaches the review instructions", "The pipeline's wall time"
    "demo": dict(max_steps=6, rollout_size=64, batch_size=32, learning_rate=5e-5, warmup_steps=2, eval_every=6,
                 eval_examples=500, max_new_tokens=64, kl_horizon=1024, eval_samples=2, kl_coef=0.05),
    "gpt2-zh-small": dict(max_steps=200, rollout_size=64, batch_size=32, learning_rate=1e-6, warmup_steps=10,
                          eval_every=50, eval_examples=500, max_new_tokens=64, save_every=50, kl_horizon=2560,
                          eval_samples=4, kl_coef=0.05),
}


def parse_args(argv=None):
    p = stage_parser("Stage 3: PPO against the reward model, or on verifiable tasks (--verifier), with a KL penalty "
                     "to the SFT model.",
                     None, {**DEFAULTS, **{f"{k} with --verifier": v for k, v in TASK_DEFAULTS.items()}},
                     steps="PPO iterations (a rollout of --rollout_size prompts, then the updates on it)",
                     examples="held-out prompts (the first of --val_prompts_file)")
    add_online_arguments(p, "PPO")
    p.add_argument("--ppo_epochs", type=positive_int, default=4, help="passes over each rollout batch")
    p.add_argument("--target_kl", type=non_negative_float, default=DEFAULT_TARGET_KL,
                   help="adaptive KL control (Ziegler et al. 2019): steer beta so the KL to the SFT model stays near "
                        "this many nats per response; past it the reward-hacking flag is raised; 0 keeps beta fixed")
    p.add_argument("--kl_horizon", type=positive_int,
                   help="the KL controller's horizon in samples: each iteration beta changes by up to 20%% x "
                        "rollout samples / horizon (Ziegler et al. used 10000 for runs of a million samples)")
    p.add_argument("--max_approx_kl", type=non_negative_float, default=0.02,
                   help="stop an iteration's PPO epochs once the mean approximate KL between the sampling policy and "
                        "the updated one passes this many nats per token (0: never stop early)")
    p.add_argument("--gamma", type=unit_interval, default=1.0, help="discount, in [0, 1]")
    p.add_argument("--lam", type=unit_interval, default=0.95, help="GAE lambda, in [0, 1]")
    p.add_argument("--cliprange_value", type=positive_float, default=0.2, help="value clip")
    p.add_argument("--vf_coef", type=positive_float, default=0.5, help="weight of the value loss")
    args = p.parse_args(argv)
    check_lora_arguments(args)
    return online_defaults(args, DEFAULTS, TASK_DEFAULTS, {False: default_path("checkpoints", "ppo"),
                                                           True: default_path("checkpoints", "ppo-tasks")})


# --- the maths of PPO, one function each -----------------------------------------------------------------------


def masked_whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std with mean and variance taken over ``mask == 1`` only; padded positions come back 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_penalised_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float):
    """Per-token rewards (B, R): ``-kl_coef * (logprobs - ref_logprobs)`` on every real response token, plus the
    reward model's ``scores`` (B,) on each row's last real response token. Padding gets 0."""
    rewards = torch.where(mask.bool(), -kl_coef * (logprobs - ref_logprobs), 0.0)  # (B, R)
    last = last_real_index(mask)  # (B,)
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016) over (B, R) response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}; past the last real token V and
    A are 0. Returns (advantages, returns = advantages + values), both (B, R), 0 on padding.
    """
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value, next_advantage = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t]
        advantages[:, t] = next_advantage
    return advantages, (advantages + values) * mask


def ppo_losses(logprobs, old_logprobs, advantages, values, old_values, returns, mask, cliprange, cliprange_value):
    """The clipped surrogate policy loss (Schulman et al. 2017) and the clipped value loss, averaged over real
    tokens. All inputs (B, R). Returns (policy_loss, value_loss, clip_fraction, approx_kl).

    Padded positions are set aside before ``exp`` (a select: ``inf * 0`` would be NaN) and by ``masked_mean``."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)  # (B, R), 0 on padding
    ratio = torch.exp(log_ratio)  # pi_new / pi_old
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    policy_loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    value_loss = 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (values_clipped - returns) ** 2), mask)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean(0.5 * log_ratio ** 2, mask)
    return policy_loss, value_loss, clip_fraction, approx_kl


def adaptive_kl_coef(beta: float, kl: float, target: float, samples: int, horizon: int) -> float:
    """One step of the proportional KL controller of Ziegler et al. (2019): the error
    ``e = clip(kl / target - 1, -0.2, 0.2)`` moves beta to ``beta * (1 + e * samples / horizon)``. KL above the
    target raises the penalty, below it lowers it; the horizon (in samples) sets how fast, and the clip keeps one
    noisy iteration from moving beta by more than ``20% * samples / horizon``."""
    error = max(-0.2, min(0.2, kl / target - 1))
    return beta * (1 + error * samples / horizon)


class PolicyAndCritic(nn.Module):
    """The two trained networks in one module, so one optimizer, one Accelerate wrapper and one training state
    cover both. ``forward`` -> {"logits": (B, T, V) policy (or (B, k, V), the last k positions, with
    ``logits_to_keep``), "values": (B, T) critic}."""

    def __init__(self, policy, critic):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, input_ids, attention_mask, logits_to_keep: int = 0):
        logits = self.policy(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep)["logits"]
        return {"logits": logits, "values": self.critic(input_ids, attention_mask)["values"]}


# panels of curves.png: a tuple puts the rollouts' value and the held-out one (val_*) in one panel
CURVES = [("score", "val_score"), ("judge", "val_judge"), ("kl", "val_kl"), "kl_coef", ("entropy", "val_entropy"),
          ("length", "val_length"), ("eos_share", "val_eos_share"), ("distinct_2", "val_distinct_2"),
          ("longest_run", "val_longest_run"), ("clip_fraction", "approx_kl"), "ppo_epochs", "value_loss"]
PPO_STATS = ("policy_loss", "value_loss", "clip_fraction", "approx_kl")  # what ppo_losses returns, in its order


def make_critic(online) -> RewardModel:
    """The critic V(s): a ``RewardModel`` started from the reward model, as InstructGPT does, so its values have a
    sensible scale from the first iteration; with a verifier there is no reward model, and it starts from the SFT
    policy with a head that says 0, the value of a reward not yet seen."""
    critic = RewardModel(online.policy.cfg)
    if online.reward_model is not None:
        critic.load_state_dict(online.reward_model.state_dict())
    else:
        # a network of its own, trained whole even when the policy trains LoRA adapters (zero at step 0, left out)
        critic.backbone.load_state_dict({k: v for k, v in online.policy.state_dict().items() if ".lora_" not in k})
        torch.nn.init.zeros_(critic.head.linear.weight)
        torch.nn.init.zeros_(critic.head.linear.bias)
    return critic


def ppo_update(model, optimizer, stage, data, advantages, returns, args) -> dict:
    """The update phase of one iteration: up to ``--ppo_epochs`` passes over the rollout ``data`` in shuffled
    minibatches of ``--batch_size``, each one gradient step on the clipped policy loss plus ``--vf_coef`` times the
    clipped value loss (``ppo_losses``) of ``model`` (``PolicyAndCritic``). The passes stop early once a pass's
    mean approximate KL to the policy that sampled passes ``--max_approx_kl``: the rollout no longer describes the
    policy. Returns the ``PPO_STATS`` averaged over the minibatches that ran, and ``ppo_epochs``, the passes run."""
    accelerator = stage.accelerator
    mask, P, n = data["response_mask"], data["prompt_len"], len(data["input_ids"])
    R = data["input_ids"].shape[1] - P
    stats = []  # one row per minibatch, PPO_STATS in order
    for epoch in range(1, args.ppo_epochs + 1):  # noqa: B007 (read after the loop: the passes run)
        order = torch.randperm(n)
        for start in range(0, n, args.batch_size):
            idx = order[start:start + args.batch_size].to(accelerator.device)
            with stage.accumulate():
                out = model(data["input_ids"][idx], data["attention_mask"][idx], logits_to_keep=R + 1)
                logits = out["logits"][:, :-1]  # (b, R, V): the head reads the response positions only
                logprobs = token_logprobs(logits, data["input_ids"][idx, P:])  # (b, R)
                values = out["values"][:, P - 1:-1].float()  # (b, R)
                policy_loss, value_loss, clip_fraction, approx_kl = ppo_losses(
                    logprobs, data["logprobs"][idx], advantages[idx], values, data["values"][idx], returns[idx],
                    mask[idx], args.cliprange, args.cliprange_value)
                accelerator.backward(policy_loss + args.vf_coef * value_loss)
            if stage.clip_gradients():  # to --max_grad_norm; False: a non-finite gradient, never applied
                optimizer.step()
            optimizer.zero_grad()
            stats.append(torch.stack([policy_loss, value_loss, clip_fraction, approx_kl]).detach())
        minibatches = -(-n // args.batch_size)  # this pass's rows of stats
        pass_kl = torch.stack(stats[-minibatches:])[:, PPO_STATS.index("approx_kl")].mean().item()
        if args.max_approx_kl and mean_over_processes(accelerator, [pass_kl])[0] > args.max_approx_kl:
            break
    return {**dict(zip(PPO_STATS, torch.stack(stats).mean(0).tolist())), "ppo_epochs": epoch}


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    tokenizer = load_tokenizer(args.tokenizer)

    # --- prompts to practise on, held-out ones to measure the gain, the policy and a frozen reference from SFT,
    # the reward (the frozen RM's score, or a verifier's 1 or 0) and the critic ---------------------------------------
    online = Online(args, tokenizer, accelerator.device)
    prompts = online.prompts
    critic = make_critic(online)
    speed_up(online.policy, *online.scorers, critic)  # the same models, their fast paths on (gpt_fast.py)

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -----------------------
    model = PolicyAndCritic(online.policy, critic)
    optimizer = make_optimizer(model, args.learning_rate, args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)  # model: Accelerate's wrapper, what trains
    model.eval()  # dropout off everywhere: rollouts and updates see the same network
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)
    policy, critic = plain.policy, plain.critic  # the plain modules: they sample, and are saved
    stage = StageRun("ppo", args, accelerator, model, optimizer, tokenizer, online.parent,
                     plot=("curves.png", CURVES), unwrapped_model=policy, extra={"kl_coef": args.kl_coef},
                     write_state=lambda d: save_model(critic, os.path.join(d, "critic.safetensors")),
                     other_models=online.scorers)
    if args.resume:
        load_model(critic, os.path.join(args.output_dir, "state", "critic.safetensors"))
    kl_limit = args.target_kl or DEFAULT_TARGET_KL  # the flag's KL budget, also when beta is fixed
    held_out = online.held_out(stage, policy)
    sft = held_out.before()  # step 0 of the val_* curves: the SFT policy before any update

    # --- the loop: PPO's algorithm, one iteration per step -------------------------------------------------------
    schedule = BatchSchedule(len(prompts), args.rollout_size, 1, accelerator.num_processes, args.seed)
    for step in stage.steps():
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))  # warm-up, cosine
        # 1. sample: answers, the log-probs of policy and reference, the critic's values
        batch_prompts = [prompts[i] for i in schedule.indices(step, 0, accelerator.process_index)]
        with accelerator.autocast():  # policy, reference, critic and RM alike: KL is exactly 0 before any update
            data = online.rollout(policy, batch_prompts, critic=critic)
            # 2. score: (B, K), one column per reward; their weighted sum is the answer's score
            rewards = online.score(data)
        # 3. per-token rewards: the score on the last token, minus beta times the KL to the reference on each
        mask, beta = data["response_mask"], stage.extra["kl_coef"]
        scores = penalise_unfinished(torch.nansum(rewards * online.weights, dim=1), data["ended"],
                                     args.no_eos_penalty)  # (B,)
        token_rewards = kl_penalised_rewards(scores, data["logprobs"], data["ref_logprobs"], mask, beta)
        # 4. advantages by GAE from the critic's values, whitened, and the returns the critic learns
        advantages, returns = gae(token_rewards, data["values"], mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask)
        # the rollout's monitors, averaged over every process's rollouts: beta must move alike everywhere
        monitors = online.rollout_row(data, rewards)
        monitors = dict(zip(monitors, mean_over_processes(accelerator, list(monitors.values()))))
        # 5. update: the clipped updates of policy and critic
        stats = ppo_update(model, optimizer, stage, data, advantages, returns, args)
        stage.end_step(stats["policy_loss"] + stats["value_loss"], tokens=int(data["attention_mask"].sum()))
        # 6. beta follows the KL of the rollout to the reference (adaptive KL control)
        if args.target_kl > 0:
            stage.extra["kl_coef"] = adaptive_kl_coef(beta, monitors["kl"], args.target_kl,
                                                      len(batch_prompts) * accelerator.num_processes,
                                                      args.kl_horizon)
        # 7. log, with the held-out monitors every --eval_every iterations but the last (the final measurement is it)
        row = {**monitors, "kl_coef": stage.extra["kl_coef"], **stats}
        if (step + 1) % args.eval_every == 0 and step + 1 < args.max_steps:
            row.update(held_out.val_row(f"iteration {step + 1}"))
        stage.log(row, show=("score", "kl", "kl_coef"))
    if not stage.completed:
        return stage.finish()
    stage.save_before_final_evaluation()  # a Ctrl-C below keeps the trained steps; --resume runs only what follows

    # --- SFT and PPO on held-out prompts, and the reward-hacking flag -----------------------------------------------
    return stage.finish(held_out.summary(sft, held_out.after("ppo", sft, kl_limit), "PPO"))


if __name__ == "__main__":
    run(main)
