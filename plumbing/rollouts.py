"""A policy's responses, sampled and measured: what every online aligner (3-PPO.py, 3-GRPO.py) and every
measurement of answers (the held-out monitors, the verifiable tasks) does with them, written once.

* log-probabilities: ``token_logprobs`` of given tokens, ``sequence_logprobs`` of a labelled response (DPO),
  ``response_logits`` (the head on the response positions only; given ``prompt_of``, each prompt read once),
  ``response_logprobs`` (a rollout's, measured in groups of rows cut to their length, each prompt read once),
  ``masked_mean``, ``entropy_from_logits``, ``kl_per_response``;
* a prompt read once for its answers: ``PromptCache`` (a KV cache that keeps gradients), ``read_each_prompt``,
  ``read_prompts``, ``logits_after_prompts``;
* sampling: ``sample_responses`` (batched, left-padded prompts through the chat template and the KV-cached
  ``generate``, k answers to each prompt from one reading of it), ``response_mask_after``,
  ``response_token_lists``, ``rollout`` (the samples and their log-probabilities: everything an update needs
  about them but their reward), ``penalise_unfinished`` (answers cut off without ``[SEP]``).

Scoring is the next step of each loop, not part of the rollout: the rewards are in ``alignment.py`` (the reward
model's, and the list an aligner sums) and ``tasks.py`` (the verifiers').
"""

from __future__ import annotations

import torch

from chinese_tokenizer import EOS_ID, chat_prompt_ids
from gpt_fast import generate
from plumbing.batching import pad_left
from plumbing.flops import counting_as


def token_logprobs(logits, tokens):
    """log softmax(logits)[token]: (B, T, V), (B, T) -> (B, T), in float32 (bf16 logits would lose the small
    differences between policy and reference that KL and the ratios are made of)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(logits, labels):
    """log pi(response | prompt) per row: the sum of ``token_logprobs`` over the positions whose label is not -100.

    Args:
        logits: (B, T, V), position t predicting ``labels[:, t]`` (labels already shifted, as
            ``batching.chat_example`` makes them).
        labels: (B, T) next-token ids, -100 on the prompt and on padding.
    Returns:
        (B,) float32 log-probabilities, in nats.
    """
    keep = labels != -100  # (B, T)
    logp = token_logprobs(logits, labels.clamp(min=0))  # (B, T); ignored positions read id 0, then drop out
    return torch.where(keep, logp, 0.0).sum(dim=1)  # (B,); a select, so a non-finite ignored value cannot leak


def masked_mean(x, mask):
    """Mean of ``x`` over positions where ``mask`` is 1 (a scalar). The other positions are set aside with a select,
    not multiplied by 0: an inf or NaN there (a padded position's ratio) would make ``inf * 0 = NaN`` of the mean."""
    return torch.where(mask.bool(), x, 0.0).sum() / mask.sum().clamp(min=1)


def entropy_from_logits(logits):
    """Entropy of softmax(logits) per position: (B, T, V) -> (B, T), in nats."""
    return entropy_of(torch.log_softmax(logits.float(), dim=-1))


def entropy_of(logp):
    """Entropy per position from log-probabilities already computed: (B, T, V) -> (B, T), in nats."""
    return -(logp.exp() * logp).sum(-1)


def kl_per_response(logprobs, ref_logprobs, mask):
    """KL(pi || pi_ref) of each sampled response, in nats: the sum over its real tokens of log pi(a_t) -
    log pi_ref(a_t) at the sampled tokens a_t. (B, R) x 3 -> (B,). Averaged over responses sampled from pi it is an
    unbiased estimate of the KL between the two models' distributions of whole responses; one response's value can
    be negative."""
    return torch.where(mask.bool(), logprobs - ref_logprobs, 0.0).sum(1)


def penalise_unfinished(scores, ended, penalty: float):
    """RM scores (B,) minus ``penalty`` for each response that did not end with [SEP] (``ended`` (B,) bool):
    an answer cut off by the token limit is not a finished answer, whatever the RM thinks of its first part."""
    return scores - penalty * (~ended).to(scores.dtype)


def response_mask_after(responses, eos_id: int):
    """(B, R) generated ids -> 0/1 mask of the real response: every token up to and including the first eos."""
    is_eos = (responses == eos_id).long()
    ended_before = is_eos.cumsum(dim=1) - is_eos  # eos tokens strictly before t
    return (ended_before == 0).long()


def prompt_text(prompt):
    """What the policy reads of a prompt: the prompt itself (a string or a conversation), or a task's ``"prompt"``
    (a verifiable task is a dict that also carries its answer, ``records.read_tasks``)."""
    return prompt["prompt"] if isinstance(prompt, dict) else prompt


@torch.no_grad()
def sample_responses(policy, prompts, tokenizer, args, context_length, device, samples: int = 1):
    """Sample ``samples`` responses to each prompt from ``policy`` (batched, left-padded prompts, KV cache): the
    one way every stage draws k answers to a prompt, rows b*k .. b*k+k-1 answering prompt b, from one reading of
    the prompt (``gpt_fast.generate``'s ``num_samples``; the same draws as the prompt written k times).

    Returns (sequences (B, P+R), attention_mask (B, P+R), response_mask (B, R), P) with B = len(prompts) *
    samples: the mask covers each response up to and including its first [SEP]; what ``generate`` filled in after
    it is padding.
    """
    room = context_length - args.max_new_tokens  # the prompt keeps its last tokens so the whole sequence fits
    batch = pad_left([chat_prompt_ids(prompt_text(p), tokenizer, room) for p in prompts])
    query, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)  # (B, P)
    # temperature 1: the samples come from the policy itself, whose log-probs the updates and the KL use
    sequences = generate(policy, query, args.max_new_tokens, context_length, temperature=1.0, eos_id=EOS_ID,
                         attention_mask=query_mask, num_samples=samples)  # (B, P + R)
    P = query.shape[1]
    response_mask = response_mask_after(sequences[:, P:], EOS_ID)  # (B, R)
    query_mask = query_mask.repeat_interleave(samples, dim=0)
    return sequences, torch.cat([query_mask, response_mask], dim=1), response_mask, P


def response_logits(model, sequences, attention_mask, prompt_len: int, prompt_of=None):
    """The logits that predict the response tokens of ``sequences`` (B, P+R): (B, R, V), position P - 1 + j
    predicting response token j. Only the last R + 1 positions go through the output head (the costliest layer
    of a small model), the last of them dropped: it would predict past the sequence.

    ``prompt_of`` (B,), given: rows with the same value answer the same prompt (GRPO's group of each row), and each
    prompt is read once (``read_each_prompt``, ``logits_after_prompts``), with gradient when it is on: the answers'
    positions attend to their prompt's keys and values, and their gradient flows back through them. The same
    logits up to rounding.
    """
    if prompt_of is None:
        R = sequences.shape[1] - prompt_len
        return model(sequences, attention_mask=attention_mask, logits_to_keep=R + 1)["logits"][:, :-1]  # (B, R, V)
    read, groups = read_each_prompt(model, sequences, attention_mask, prompt_len, prompt_of)
    return logits_after_prompts(model, read, groups, sequences, attention_mask, prompt_len)  # (B, R, V)


class PromptCache:
    """The keys and values of prompts read once, for the passes over their answers: a KV cache with the
    ``update(layer, keys, values)`` and ``length`` that ``GPTModel`` reads (``gpt_model.KVCache``'s), which
    concatenates instead of writing into a preallocated buffer. So its tensors stay in the autograd graph: an
    update's gradient flows from the answers back through their prompt's keys and values to the prompt's pass (an
    in-place write would overwrite what the backward pass needs). ``rows`` gives each answer its prompt's."""

    def __init__(self, keys=None, values=None, length: int = 0):
        self.keys = keys if keys is not None else {}  # layer -> (B, H, length, d_h)
        self.values = values if values is not None else {}
        self.length = length

    def update(self, layer: int, keys, values):
        """Append (B, H, T, d_h) new keys/values to the layer's; return all of them, (B, H, length + T, d_h)."""
        if layer in self.keys:
            keys, values = torch.cat([self.keys[layer], keys], dim=2), torch.cat([self.values[layer], values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def rows(self, index) -> PromptCache:
        """A cache of the rows ``index`` (a (b,) LongTensor; a row may be taken more than once: several answers to
        one prompt), this one unchanged. ``index_select``, not ``[index]``: on a CPU its backward pass
        (``index_add_``) adds the answers' gradients into their prompt's in a fixed order, where the backward of
        indexing adds them with atomic adds from several threads, whose order, and so the last bits, vary from run
        to run."""
        return PromptCache({layer: k.index_select(0, index) for layer, k in self.keys.items()},
                           {layer: v.index_select(0, index) for layer, v in self.values.items()}, self.length)


def read_each_prompt(model, sequences, attention_mask, prompt_len: int, prompt_of):
    """Each distinct prompt of ``sequences`` (B, P+R) read once (``read_prompts``), where rows with the same
    ``prompt_of`` (B,) answer the same prompt. Returns (read, groups): ``read_prompts``' result for the n distinct
    prompts, and (B,) the index of each row's prompt there. Raises ``ValueError`` when ``prompt_of`` is not one value
    per row, or when rows with the same value do not share their prompt and its mask."""
    if prompt_of.shape != sequences.shape[:1]:
        raise ValueError(f"prompt_of has shape {tuple(prompt_of.shape)}; give one prompt index per row, "
                         f"({sequences.shape[0]},)")
    prompts, groups = prompt_of.unique(return_inverse=True)  # (n,) the distinct prompts; (B,) each row's
    prompt_row = torch.zeros_like(prompts).scatter_(0, groups, torch.arange(len(groups), device=groups.device))
    P, own = prompt_len, prompt_row[groups]  # (n,) a row holding each prompt; (B,) that row for each row
    if not (torch.equal(sequences[:, :P], sequences[own, :P]) and torch.equal(attention_mask[:, :P],
                                                                             attention_mask[own, :P])):
        raise ValueError("rows with the same prompt_of must share their prompt and its mask (with samples=k, each "
                         "k rows in turn must share a prompt); these do not")
    return read_prompts(model, sequences[prompt_row, :P], attention_mask[prompt_row, :P]), groups


def read_prompts(model, prompts, attention_mask):
    """One pass over ``prompts`` (n, P) and their ``attention_mask`` that keeps their keys and values.

    Returns (cache, first): a ``PromptCache`` of the n prompts (P positions) and the logits of each prompt's last
    position, (n, 1, V), which predict the first response token.
    """
    cache = PromptCache()
    first = model(prompts, attention_mask=attention_mask, past_key_values=cache, logits_to_keep=1)["logits"]
    return cache, first  # (n, 1, V)


def logits_after_prompts(model, read, groups, sequences, attention_mask, prompt_len: int):
    """``response_logits`` of rows ``sequences`` (b, P+r) and their ``attention_mask`` whose prompts were read
    already (``read``, from ``read_prompts``; ``groups`` (b,) the index of each row's prompt there): only the
    response tokens go through the model, attending to their prompt's cached keys and values. (b, r, V): the
    prompt's last logits, then those of the response's first r - 1 tokens."""
    cache, first = read
    logits = first.index_select(0, groups)  # (b, 1, V)
    if sequences.shape[1] > prompt_len + 1:  # the last response token predicts nothing that is measured
        rest = model(sequences[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
                     past_key_values=cache.rows(groups))["logits"]  # (b, r - 1, V)
        logits = torch.cat([logits, rest], dim=1)
    return logits


def response_columns(response_mask) -> int:
    """How many response columns hold a real token in some row of ``response_mask`` (B, R) (at least 1). The
    columns after them are padding in every row: a forward pass may leave them out, and under causal attention
    leaving them out changes nothing at the columns kept."""
    return max(int(response_mask.sum(dim=1).max()), 1)


# Rows per forward pass when a rollout is measured: small enough that a group's rows have about the same length
# once sorted, large enough to keep the matrix products wide
MEASURE_ROWS = 32


@torch.no_grad()
def response_logprobs(model, sequences, attention_mask, response_mask, prompt_len: int, entropy: bool = False,
                      samples: int = 1):
    """log pi(token) of every response token of ``sequences`` (B, P+R) under ``model``, and asked for, the entropy
    of pi at every response position, both (B, R) float32 and 0 after each response's end.

    The rows go through the model in groups of ``MEASURE_ROWS`` sorted by response length, each group cut after its
    longest response (``response_columns``): a batch of 128 answers whose longest runs to the token limit but whose
    mean is 40% of it costs about 40% of the full-width pass, in time and in memory. One log-softmax serves both
    figures. Equal, at the real positions, to ``token_logprobs(response_logits(...))`` on the whole batch.

    With ``samples`` k > 1, rows b*k .. b*k+k-1 answer one prompt (``sample_responses``) and each prompt is read
    once (``read_each_prompt``), as sampling read it: the groups then run their response tokens alone against the
    cached keys and values (``logits_after_prompts``). Where prompts are long and answers short (the sentiment
    reviews: about 50 tokens, then 3) that is most of the work. The same values up to rounding (the attention over
    cached keys is another kernel call): within about 1e-5, not bit for bit.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1 (answers per prompt), got {samples}")
    B, R = response_mask.shape
    lengths = response_mask.sum(dim=1)  # (B,)
    logprobs = torch.zeros(B, R, device=sequences.device)  # (B, R)
    entropies = torch.zeros(B, R, device=sequences.device) if entropy else None
    read = None
    with counting_as("forward"):  # a scoring pass, although it reads a KV cache (flops.FlopCounter)
        if samples > 1:  # rows b*k .. b*k+k-1 answer prompt b
            prompt_of = torch.arange(B, device=sequences.device) // samples  # (B,)
            read, groups = read_each_prompt(model, sequences, attention_mask, prompt_len, prompt_of)
        order = lengths.argsort()
        for start in range(0, B, MEASURE_ROWS):
            rows = order[start:start + MEASURE_ROWS]
            r = response_columns(response_mask[rows])
            ids, mask = sequences[rows, :prompt_len + r], attention_mask[rows, :prompt_len + r]  # (b, P + r) each
            logits = (response_logits(model, ids, mask, prompt_len) if read is None else
                      logits_after_prompts(model, read, groups[rows], ids, mask, prompt_len))  # (b, r, V)
            logp = torch.log_softmax(logits.float(), dim=-1)  # (b, r, V)
            logprobs[rows, :r] = logp.gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)
            if entropy:
                entropies[rows, :r] = entropy_of(logp)
    real = response_mask.bool()
    logprobs = torch.where(real, logprobs, 0.0)  # a group's shorter rows computed a few columns past their end
    return (logprobs, torch.where(real, entropies, 0.0)) if entropy else logprobs


def each(prompts, samples: int) -> list:
    """The prompt of every row when each of ``prompts`` is answered ``samples`` times (``sample_responses``):
    each prompt ``samples`` times, side by side."""
    return [p for p in prompts for _ in range(samples)]


@torch.no_grad()
def rollout(policy, prompts, *, ref, tokenizer, args, context_length, device, samples: int = 1, critic=None):
    """Sample responses and measure what PPO and GRPO need about them, except their reward: ``samples`` answers
    to each of ``prompts`` drawn with the KV cache (``sample_responses``), then one forward pass of ``policy``
    (the log-probs of the sampled tokens and the entropy), one of the frozen ``ref`` (its log-probs, for the KL),
    and, given a ``critic``, its values. Scoring the answers is the loop's next step (``alignment.Online.score``).

    Returns a dict: prompts (B, the prompt of each row, ``each``); input_ids, attention_mask (B, P+R);
    response_mask, logprobs, ref_logprobs, entropy, values (B, R; no values when ``critic`` is None); ended (B,)
    bool, whether the response ended with [SEP]; prompt_len P.
    """
    sequences, attention_mask, response_mask, P = sample_responses(policy, prompts, tokenizer, args,
                                                                   context_length, device, samples)
    logprobs, entropy = response_logprobs(policy, sequences, attention_mask, response_mask, P, entropy=True,
                                          samples=samples)
    data = {
        "prompts": each(prompts, samples),
        "input_ids": sequences, "attention_mask": attention_mask, "response_mask": response_mask.float(),
        "logprobs": logprobs, "entropy": entropy,  # (B, R) each
        "ref_logprobs": response_logprobs(ref, sequences, attention_mask, response_mask, P, samples=samples),
        "ended": (sequences[:, P:] == EOS_ID).any(dim=1),  # (B,)
        "prompt_len": P,
    }
    if critic is not None:
        data["values"] = critic(sequences, attention_mask)["values"][:, P - 1:-1].float()  # (B, R)
    return data


def response_token_lists(data) -> list[list[int]]:
    """Each sampled response's token ids, [SEP] and what follows it removed: what the monitors count."""
    mask, P = data["response_mask"].bool(), data["prompt_len"]
    return [row[m & (row != EOS_ID)].tolist() for row, m in zip(data["input_ids"][:, P:], mask)]
