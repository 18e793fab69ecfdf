"""What the alignment stages (3-PPO.py, 3-DPO.py, 3-GRPO.py) share about a policy's responses.

* ``token_logprobs``: log pi(token | prefix) of given tokens from the logits, in float32.
* ``sequence_logprobs``: the sum of those over a response (the labels mark it; -100 elsewhere), as DPO needs.

It holds maths on tensors only: no model calls, no tokenizer, no Accelerate.
"""

from __future__ import annotations

import torch


def token_logprobs(logits, tokens):
    """log softmax(logits)[token]: (B, T, V), (B, T) -> (B, T), in float32 (bf16 logits would lose the small
    differences between policy and reference that KL and the ratios are made of)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(logits, labels):
    """log pi(response | prompt) per row: the sum of ``token_logprobs`` over the positions whose label is not -100.

    Args:
        logits: (B, T, V), position t predicting ``labels[:, t]`` (labels already shifted, as
            ``corpus.chat_example`` makes them).
        labels: (B, T) next-token ids, -100 on the prompt and on padding.
    Returns:
        (B,) float32 log-probabilities, in nats.
    """
    keep = labels != -100  # (B, T)
    logp = token_logprobs(logits, labels.clamp(min=0))  # (B, T); ignored positions read id 0, then drop out
    return (logp * keep).sum(dim=1)  # (B,)
