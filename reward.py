"""Scoring text with a reward model, and the objectives that train one (used by 2-RM.py, 3-PPO.py, generate.py).

A reward model (``gpt_model.RewardModel``) reads a (prompt, response) pair laid out by the one chat template,
``[CLS] prompt [ANS] response [SEP]``, and answers with one number: the value of its scalar head at the sequence's
last real token. That is exactly the layout PPO generates, so the reward model scores what the policy writes.

* ``score_texts``: rewards for many (prompt, response) pairs, in right-padded batches.
* ``pairwise_loss``: the Bradley–Terry loss ``-log sigmoid(r_chosen - r_rejected)`` (Bradley & Terry 1952; the
  reward-model loss of InstructGPT, Ouyang et al. 2022, section 3.5).
* ``pointwise_loss``: binary cross-entropy with the reward as the logit, for texts labelled good (1) / bad (0).
* ``pair_metrics``: loss, accuracy (how often the chosen side scores higher) and mean margin over pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chinese_tokenizer import apply_chat_template
from corpus import pad_right


@torch.no_grad()
def score_texts(model, tokenizer, prompts, responses, batch_size: int = 32, max_length: int | None = None,
                ended=None):
    """The reward of each (prompt, response) pair, as a list of floats in the input order.

    Args:
        model: a ``RewardModel`` (not wrapped by Accelerate); its device is used, and it is left in the
            train/eval mode it was in (scoring itself runs in eval mode, so dropout is off).
        prompts, responses: two lists of strings of equal length.
        batch_size: sequences per forward pass. Pairs are sorted by length first so each batch pads little; the
            scores do not depend on the batching because the reward is read at each row's last real token.
        max_length: longest sequence in tokens (default: the model's ``context_length``); longer pairs are cut as
            ``apply_chat_template`` does (the prompt from its left first).
        ended: optional list of bools, one per response: False for an answer that was cut off before it wrote
            ``[SEP]`` (it is scored without the closing ``[SEP]``, as the alignment stages score such an answer:
            the sequence as it was generated). By default every response is complete.
    Raises:
        ValueError: the lists have different lengths.
    """
    if len(prompts) != len(responses) or (ended is not None and len(ended) != len(responses)):
        raise ValueError(f"score_texts got {len(prompts)} prompts, {len(responses)} responses and "
                         f"{'no' if ended is None else len(ended)} ended flags")
    max_length = max_length or model.cfg.context_length
    encoded = [apply_chat_template(p, r, tokenizer, max_length)[0] for p, r in zip(prompts, responses)]
    if ended is not None:
        encoded = [ids if done else ids[:-1] for ids, done in zip(encoded, ended)]  # drop the template's [SEP]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores = [0.0] * len(encoded)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = pad_right([encoded[i] for i in rows])
        rewards = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))["rewards"]  # (b,)
        for i, r in zip(rows, rewards.float().tolist()):
            scores[i] = r
    model.train(was_training)
    return scores


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

    accuracy: the fraction of pairs with ``r_chosen > r_rejected`` (a tie counts as wrong);
    margin: the mean of ``r_chosen - r_rejected``; loss: ``pairwise_loss``.
    """
    r_chosen, r_rejected = torch.as_tensor(r_chosen).float(), torch.as_tensor(r_rejected).float()
    diff = r_chosen - r_rejected  # (N,)
    return {"loss": pairwise_loss(r_chosen, r_rejected).item(), "accuracy": (diff > 0).float().mean().item(),
            "margin": diff.mean().item()}
