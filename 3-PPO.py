"""Stage 3 — RLHF with PPO: the policy learns to write what the reward model prefers, held near the SFT model.

Method: InstructGPT (Ouyang et al. 2022) and its predecessor (Ziegler et al. 2019, "Fine-Tuning Language Models
from Human Preferences"): each iteration

1. rollouts: sample responses to a batch of prompts with the KV-cached ``generate`` (dropout off);
2. score: the frozen reward model scores ``[CLS] prompt [ANS] response [SEP]``; the per-token reward is
   ``-beta * (log pi(a_t) - log pi_ref(a_t))`` with the score added on the last real response token;
3. advantages: GAE (Schulman et al. 2016) over the response tokens from the critic's values, whitened over the
   real (non-padding) response tokens;
4. updates: several epochs of minibatch steps on the clipped policy objective (Schulman et al. 2017) plus the
   clipped value loss.

Models: the policy and a frozen reference copy (both from the SFT checkpoint), the frozen reward model, and a
separate critic (a ``RewardModel`` initialised from the reward model, as InstructGPT does): a separate critic
keeps the value loss from pulling on the policy's features, and starting from the RM gives it a sensible value
scale from the first iteration. Dropout is off in every model throughout, so before the first update the policy
equals the reference exactly (KL = 0) and the PPO ratio is exactly 1.

    python 3-PPO.py                 # demo preset: checkpoints/sft + checkpoints/rm -> checkpoints/ppo
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
from safetensors.torch import load_model, save_model

from alignment import token_logprobs
from checkpoint import check_output_dir, load_backbone, load_checkpoint
from chinese_tokenizer import EOS_ID, chat_prompt_ids, decode, load_tokenizer
from cli import UserError, default_path, fill_defaults, non_negative_float, positive_float, positive_int, run, \
    stage_parser
from corpus import pad_left, read_jsonl
from gpt_model import RewardModel, generate, last_real_index
from training import (BatchSchedule, StageRun, lr_at, make_accelerator, make_optimizer, markdown_table,
                      mean_over_processes, set_lr)

# max_steps = PPO iterations; batch_size = sequences per update micro-batch; rollout_size = prompts per iteration
DEFAULTS = {
    "tiny": dict(max_steps=4, rollout_size=8, batch_size=4, learning_rate=1e-4, warmup_steps=0, eval_every=2,
                 eval_examples=8, max_new_tokens=16),
    "demo": dict(max_steps=20, rollout_size=16, batch_size=8, learning_rate=1e-4, warmup_steps=2, eval_every=10,
                 eval_examples=48, max_new_tokens=40),
    "gpt2-zh-small": dict(max_steps=400, rollout_size=64, batch_size=16, learning_rate=1e-5, warmup_steps=10,
                          eval_every=50, eval_examples=200, max_new_tokens=64, save_every=50),
    "uer-gpt2-chinese": dict(max_steps=400, rollout_size=64, batch_size=16, learning_rate=1e-5, warmup_steps=10,
                             eval_every=50, eval_examples=200, max_new_tokens=64, save_every=50),
}


def parse_args(argv=None):
    p = stage_parser("Stage 3: PPO against the reward model with a KL penalty to the SFT model.",
                     default_path("checkpoints", "ppo"), DEFAULTS)
    p.add_argument("--policy", default=default_path("checkpoints", "sft"), help="SFT checkpoint: policy and reference")
    p.add_argument("--reward", default=default_path("checkpoints", "rm"), help="reward model checkpoint (2-RM.py)")
    p.add_argument("--prompts_file", default=default_path("data", "ppo", "prompts.jsonl"),
                   help='.jsonl lines with a "prompt" (and "split": "train"/"test"): what the policy answers')
    p.add_argument("--val_prompts_file", default=default_path("data", "ppo", "val_prompts.jsonl"),
                   help="held-out prompts: mean RM score before and after PPO")
    p.add_argument("--rollout_size", type=positive_int, help="prompts sampled per iteration (per process)")
    p.add_argument("--max_new_tokens", type=positive_int, help="longest response")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--ppo_epochs", type=positive_int, default=4, help="passes over each rollout batch")
    p.add_argument("--kl_coef", type=non_negative_float, default=0.05,
                   help="beta, the weight of the per-token KL penalty, at the start (see --target_kl)")
    p.add_argument("--target_kl", type=non_negative_float, default=6.0,
                   help="adaptive KL control (Ziegler et al. 2019): steer beta so the KL per response stays near "
                        "this many nats; 0 keeps beta fixed")
    p.add_argument("--gamma", type=float, default=1.0, help="discount")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    p.add_argument("--cliprange", type=positive_float, default=0.2, help="PPO ratio clip epsilon")
    p.add_argument("--cliprange_value", type=positive_float, default=0.2, help="value clip")
    p.add_argument("--vf_coef", type=positive_float, default=0.5, help="weight of the value loss")
    args = p.parse_args(argv)
    return fill_defaults(args, DEFAULTS[args.preset])


# --- the maths of PPO, one function each -----------------------------------------------------------------------

def masked_mean(x, mask):
    """Mean of ``x`` over positions where ``mask`` is 1 (a scalar)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std with mean and variance taken over ``mask == 1`` only; padded positions come back 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_penalised_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float):
    """Per-token rewards (B, R): ``-kl_coef * (logprobs - ref_logprobs)`` on every real response token, plus the
    reward model's ``scores`` (B,) on each row's last real response token. Padding gets 0."""
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask  # (B, R)
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
    tokens. All inputs (B, R). Returns (policy_loss, value_loss, clip_fraction, approx_kl)."""
    ratio = torch.exp(logprobs - old_logprobs)  # pi_new / pi_old
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    policy_loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    value_loss = 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (values_clipped - returns) ** 2), mask)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask)
    return policy_loss, value_loss, clip_fraction, approx_kl


def entropy_from_logits(logits):
    """Entropy of softmax(logits) per position: (B, T, V) -> (B, T), in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


class PolicyAndCritic(nn.Module):
    """The two trained networks in one module, so one optimizer, one Accelerate wrapper and one training state
    cover both. ``forward`` -> {"logits": (B, T, V) policy, "values": (B, T) critic}."""

    def __init__(self, policy, critic):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, input_ids, attention_mask):
        return {"logits": self.policy(input_ids, attention_mask=attention_mask)["logits"],
                "values": self.critic(input_ids, attention_mask)["values"]}


def response_mask_after(responses, eos_id: int):
    """(B, R) generated ids -> 0/1 mask of the real response: every token up to and including the first eos."""
    is_eos = (responses == eos_id).long()
    ended_before = is_eos.cumsum(dim=1) - is_eos  # eos tokens strictly before t
    return (ended_before == 0).long()


@torch.no_grad()
def sample_responses(policy, prompts, tokenizer, args, context_length, device):
    """Sample one response per prompt from ``policy`` (batched, left-padded prompts, KV cache).

    Returns (sequences (B, P+R), attention_mask (B, P+R), response_mask (B, R), P): the mask covers each
    response up to and including its first [SEP]; what ``generate`` filled in after it is padding.
    """
    room = context_length - args.max_new_tokens  # the prompt keeps its last tokens so the whole sequence fits
    batch = pad_left([chat_prompt_ids(p, tokenizer, room) for p in prompts])
    query, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)  # (B, P)
    sequences = generate(policy, query, args.max_new_tokens, context_length, temperature=args.temperature,
                         eos_id=EOS_ID, attention_mask=query_mask)  # (B, P + R)
    P = query.shape[1]
    response_mask = response_mask_after(sequences[:, P:], EOS_ID)  # (B, R)
    return sequences, torch.cat([query_mask, response_mask], dim=1), response_mask, P


@torch.no_grad()
def rollout(policy, ref, critic, reward_model, prompts, tokenizer, args, context_length, device):
    """Sample responses and compute everything PPO needs about them.

    Returns a dict: input_ids, attention_mask (B, P+R); response_mask, logprobs, ref_logprobs, values (B, R);
    scores (B,); prompt_len P.
    """
    sequences, attention_mask, response_mask, P = sample_responses(policy, prompts, tokenizer, args,
                                                                   context_length, device)
    responses = sequences[:, P:]  # (B, R)
    # logits at position t predict token t + 1: response token j is predicted at column P - 1 + j
    logits = policy(sequences, attention_mask=attention_mask)["logits"][:, P - 1:-1]  # (B, R, V)
    ref_logits = ref(sequences, attention_mask=attention_mask)["logits"][:, P - 1:-1]  # (B, R, V)
    return {
        "input_ids": sequences, "attention_mask": attention_mask, "response_mask": response_mask.float(),
        "logprobs": token_logprobs(logits, responses), "ref_logprobs": token_logprobs(ref_logits, responses),
        "values": critic(sequences, attention_mask)["values"][:, P - 1:-1].float(),  # (B, R)
        "scores": reward_model(sequences, attention_mask)["rewards"].float(),  # (B,)
        "prompt_len": P,
    }


@torch.no_grad()
def mean_score(policy, reward_model, prompts, tokenizer, args, context_length, device, seed):
    """Mean RM score of one sampled response per prompt (fixed seed, so SFT and PPO policies are compared on the
    same draws of randomness), and every (prompt, response, score)."""
    scores, examples = [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), args.rollout_size):
            batch = prompts[start:start + args.rollout_size]
            sequences, attention_mask, response_mask, P = sample_responses(policy, batch, tokenizer, args,
                                                                           context_length, device)
            batch_scores = reward_model(sequences, attention_mask)["rewards"].float()  # (B,)
            scores += batch_scores.tolist()
            for prompt, ids, mask, score in zip(batch, sequences[:, P:], response_mask, batch_scores):
                examples.append({"prompt": prompt, "response": decode(ids[mask.bool()], tokenizer),
                                 "score": round(score.item(), 3)})
    return sum(scores) / len(scores), examples


def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    check_output_dir(args.output_dir, args.overwrite, args.resume)
    device = accelerator.device
    tokenizer = load_tokenizer(args.tokenizer)

    # --- data: prompts to practise on and held-out prompts to measure the gain ---------------------------------
    prompts = [r["prompt"] for r in read_jsonl(args.prompts_file, ("prompt",))]
    val_prompts = [r["prompt"] for r in read_jsonl(args.val_prompts_file, ("prompt",))][:args.eval_examples]

    # --- models: policy + frozen reference from SFT, frozen RM, critic initialised from the RM -------------------
    policy, parent = load_backbone(args.policy, "--policy", tokenizer, "1-SFT.py")
    ref = copy.deepcopy(policy)
    reward_model, _, _ = load_checkpoint(args.reward, "reward")
    if reward_model.cfg.vocab_size != policy.cfg.vocab_size:
        raise UserError(f"--reward {args.reward} has vocab_size {reward_model.cfg.vocab_size} but --policy "
                        f"{args.policy} has {policy.cfg.vocab_size}; train both from the same tokenizer")
    critic = RewardModel(reward_model.cfg)
    critic.load_state_dict(reward_model.state_dict())
    for frozen in (ref, reward_model):
        frozen.requires_grad_(False).eval().to(device)
    context_length = min(policy.cfg.context_length, reward_model.cfg.context_length)
    if args.max_new_tokens > context_length - 3:
        raise UserError(f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in a context of "
                        f"{context_length} (the shorter of policy and reward model); lower it")

    # --- optimizer, Accelerate, and the stage's plumbing (which resumes a run given --resume) -----------------------
    trained = PolicyAndCritic(policy, critic)
    optimizer = make_optimizer(trained, args.learning_rate, args.weight_decay)
    trained, optimizer = accelerator.prepare(trained, optimizer)
    trained.eval()  # dropout off everywhere: rollouts and updates see the same network
    unwrapped = accelerator.unwrap_model(trained)
    stage = StageRun("ppo", args, accelerator, trained, optimizer, tokenizer,
                     {**parent, "reward": os.path.abspath(args.reward)},
                     plot=("curves.png", ["score", "kl", "clip_fraction", "entropy", "value_loss", "val_score"]),
                     saved=unwrapped.policy, extra={"kl_coef": args.kl_coef},
                     write_state=lambda d: save_model(unwrapped.critic, os.path.join(d, "critic.safetensors")))
    if args.resume:
        load_model(unwrapped.critic, os.path.join(args.output_dir, "state", "critic.safetensors"))

    def held_out_score(tag):
        with accelerator.autocast():  # the precision of the updates, so that scores and KL compare like with like
            score, examples = mean_score(unwrapped.policy, reward_model, val_prompts, tokenizer, args,
                                         context_length, device, args.seed)
        stage.print(f"{tag}: mean RM score on {len(val_prompts)} held-out prompts = {score:.3f}")
        return score, examples

    if stage.step == 0:  # step 0 of the val_score curve: the SFT policy before any update
        sft_score = held_out_score("SFT policy")[0]
        stage.log({"val_score": sft_score, "val_score_sft": sft_score})
    sft_score = stage.metrics.rows[0]["val_score_sft"]

    # --- the loop: rollouts, advantages, PPO epochs ------------------------------------------------------------
    schedule = BatchSchedule(len(prompts), args.rollout_size, 1, accelerator.num_processes, args.seed)
    for step in stage.steps():
        batch_prompts = [prompts[i] for i in schedule.indices(step, 0, accelerator.process_index)]
        with accelerator.autocast():  # policy, reference, critic and RM alike: KL is exactly 0 before any update
            data = rollout(unwrapped.policy, ref, unwrapped.critic, reward_model, batch_prompts, tokenizer, args,
                           context_length, device)
        mask = data["response_mask"]
        beta = stage.extra["kl_coef"]
        rewards = kl_penalised_rewards(data["scores"], data["logprobs"], data["ref_logprobs"], mask, beta)
        advantages, returns = gae(rewards, data["values"], mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask)
        # mean over every process's rollouts: the KL controller must move beta the same way everywhere
        score, kl = mean_over_processes(accelerator, [data["scores"].mean().item(), (
            (data["logprobs"] - data["ref_logprobs"]) * mask).sum(1).mean().item()])

        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.max_steps))
        P, n = data["prompt_len"], len(batch_prompts)
        stats = []
        for epoch in range(args.ppo_epochs):
            order = torch.randperm(n)
            for start in range(0, n, args.batch_size):
                idx = order[start:start + args.batch_size].to(device)
                with stage.accumulate():
                    out = trained(data["input_ids"][idx], data["attention_mask"][idx])
                    logits = out["logits"][:, P - 1:-1]  # (b, R, V)
                    logprobs = token_logprobs(logits, data["input_ids"][idx, P:])  # (b, R)
                    values = out["values"][:, P - 1:-1].float()  # (b, R)
                    policy_loss, value_loss, clip_fraction, approx_kl = ppo_losses(
                        logprobs, data["logprobs"][idx], advantages[idx], values, data["values"][idx],
                        returns[idx], mask[idx], args.cliprange, args.cliprange_value)
                    stage.backward(policy_loss + args.vf_coef * value_loss)
                with torch.no_grad():
                    entropy = masked_mean(entropy_from_logits(logits), mask[idx])
                stats.append(torch.stack([policy_loss, value_loss, clip_fraction, approx_kl, entropy]).detach())
        policy_loss, value_loss, clip_fraction, approx_kl, entropy = torch.stack(stats).mean(0).tolist()
        stage.end_step(policy_loss + value_loss, tokens=int(data["attention_mask"].sum()))
        if args.target_kl > 0:  # adaptive KL controller of Ziegler et al. (2019), horizon 10000 samples
            error = max(-0.2, min(0.2, kl / args.target_kl - 1))
            stage.extra["kl_coef"] = beta * (1 + error * n * accelerator.num_processes / 10000)
        row = {"score": score, "kl": kl, "kl_coef": stage.extra["kl_coef"], "clip_fraction": clip_fraction,
               "entropy": entropy, "policy_loss": policy_loss, "value_loss": value_loss, "approx_kl": approx_kl,
               "response_len": mask.sum(1).mean().item()}
        if stage.eval_due and not stage.completed:
            row["val_score"] = held_out_score(f"iteration {stage.step}")[0]
        stage.log(row, show=("score", "kl", "clip_fraction"))
    if not stage.completed:
        return stage.finish()

    # --- the gain on held-out prompts -----------------------------------------------------------------------------
    ppo_score, examples = held_out_score("PPO policy")
    stage.metrics.rows[-1]["val_score"] = ppo_score
    stage.results.update(val_score_sft=sft_score, val_score_ppo=ppo_score, val_score_gain=ppo_score - sft_score,
                         kl=stage.metrics.rows[-1]["kl"])
    stage.files["samples.md"] = lambda path: write_samples(path, examples[:12])
    return stage.finish(f"held-out RM score {sft_score:.3f} (SFT) -> {ppo_score:.3f} (PPO), "
                        f"KL {stage.results['kl']:.2f} nats/response")


def write_samples(path, examples):
    """``samples.md``: the PPO policy's held-out answers with their RM scores."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_table(("prompt", "response", "RM score"),
                               [(e["prompt"], e["response"], e["score"]) for e in examples]))


if __name__ == "__main__":
    run(main)
