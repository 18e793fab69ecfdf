"""Scoring text with a reward model (2-RM.py, the aligners, generate.py, serve.py), and the one rule that counts a
pair as ranked right.

A reward model (``gpt_model.RewardModel``) reads a (prompt, response) pair laid out by the one chat template,
``[CLS] prompt [ANS] response [SEP]``, and answers with one number: the value of its scalar head at the sequence's
last real token. That is exactly the layout PPO generates, so the reward model scores what the policy writes.

* ``score_texts``: rewards for many (prompt, response) pairs, in right-padded batches.
* ``pairs_ranked_right``: how many (chosen, rejected) pairs score the chosen side higher, a tie counting half: the
  pair accuracy of the reward model (2-RM.py), of DPO's implicit reward (3-DPO.py) and of the naive Bayes
  baseline (``baselines.py``), so the three figures on the report card are counted alike.

The RM's training objectives (the Bradley–Terry pairwise loss and the pointwise one) are part of its story and
stay in 2-RM.py.
"""

from __future__ import annotations

import torch

from chinese_tokenizer import apply_chat_template
from plumbing.batching import pad_right


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


def pairs_ranked_right(chosen, rejected):
    """How many of N pairs rank the chosen side above the rejected one: ``(N,)`` scores of each side (tensors or
    lists) -> a 0-d float64 tensor. A tie counts half, the expected count of a coin toss between the two: a
    scorer that cannot tell the sides apart (DPO's policy at step 0, which is its own reference) gets N / 2,
    chance, not 0. This is the rule of the all-pairs AUC (Mann-Whitney) restricted to the given pairs."""
    chosen, rejected = torch.as_tensor(chosen, dtype=torch.float64), torch.as_tensor(rejected, dtype=torch.float64)
    return (chosen > rejected).sum(dtype=torch.float64) + 0.5 * (chosen == rejected).sum(dtype=torch.float64)
