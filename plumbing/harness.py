"""Our side of the ``lm-eval`` tasks we ship (``data/lm_eval/``): the same figures computed with our own model, so
that a number ``lm-eval`` prints for an exported checkpoint can be checked against the model that was trained.

* ``multiple_choice_accuracy``: for each problem, the log-probability of each choice as the answer after the chat
  prompt ``[CLS] prompt [ANS]``, summed over its tokens; the problem counts as right when the likeliest choice is
  the answer (the first of equal ones). ``zh_sentiment_mc`` with ``--apply_chat_template``: ``lm-eval``'s ``acc``.
* ``rolling_log_likelihood`` and ``byte_perplexity``: each document's tokens scored in windows of at most the
  model's context, the first token after one prefix token ([SEP], where our pretraining documents start), each
  later window predicting the next ``context_length`` tokens from the ``context_length`` tokens before its end;
  perplexity per UTF-8 byte, exp(-sum of log-probabilities / sum of bytes). ``zh_val_perplexity`` with
  ``prefix_token_id=102``: ``lm-eval``'s ``byte_perplexity`` and ``bits_per_byte`` (its rolling windows,
  ``lm_eval.utils.get_rolling_token_windows`` with a context of 1, are these).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from chinese_tokenizer import SEP_ID, chat_messages_ids, encode


@torch.no_grad()
def continuation_log_likelihood(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) under ``model`` (a ``GPTModel``): the sum over the continuation's tokens of
    their log-probabilities, in nats. The two together must fit in the model's context."""
    ids = torch.tensor([context + continuation])  # (1, T)
    logits = model(ids)["logits"][0, len(context) - 1:-1].float()  # (C, V): the positions that predict them
    log_probs = F.log_softmax(logits, dim=-1)
    return float(log_probs.gather(-1, torch.tensor(continuation)[:, None]).sum())


def multiple_choice_accuracy(model, tokenizer, problems, choices) -> tuple[float, list[int]]:
    """(accuracy, the index of the chosen choice per problem) for ``problems`` ({"prompt", "answer"} rows) whose
    answer is one of ``choices``, each choice scored as the assistant's answer to the prompt."""
    picked, right = [], 0
    for problem in problems:
        context = chat_messages_ids([("user", problem["prompt"])], tokenizer)
        scores = [continuation_log_likelihood(model, context, encode(choice, tokenizer)) for choice in choices]
        best = max(range(len(choices)), key=lambda i: (scores[i], -i))
        picked.append(best)
        right += choices[best] == problem["answer"]
    return right / len(problems), picked


def rolling_log_likelihood(model, ids: list[int], prefix_id: int = SEP_ID) -> float:
    """log p(ids) in nats, with every token scored once: windows predicting ``context_length`` tokens each, the
    first from ``prefix_id`` on, every later one from the ``context_length`` tokens that end where it ends."""
    n, total = model.cfg.context_length, 0.0
    sequence = [prefix_id] + ids  # sequence[i] predicts ids[i]
    for start in range(0, len(ids), n):
        end = min(start + n, len(ids))
        window = sequence[max(0, end - n):end]  # the inputs; the last (end - start) of them predict ids[start:end]
        with torch.no_grad():
            logits = model(torch.tensor([window]))["logits"][0, -(end - start):].float()  # (P, V)
        log_probs = F.log_softmax(logits, dim=-1)
        total += float(log_probs.gather(-1, torch.tensor(ids[start:end])[:, None]).sum())
    return total


def byte_perplexity(model, tokenizer, texts, prefix_id: int = SEP_ID) -> tuple[float, float]:
    """(perplexity per UTF-8 byte, bits per byte) of ``texts``, each scored whole by ``rolling_log_likelihood``."""
    log_likelihood = sum(rolling_log_likelihood(model, encode(text, tokenizer), prefix_id) for text in texts)
    nbytes = sum(len(text.encode("utf-8")) for text in texts)
    return math.exp(-log_likelihood / nbytes), -log_likelihood / nbytes / math.log(2)
