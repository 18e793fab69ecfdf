"""Counting baselines: what plain counting gets on the stages' own splits, so a learned figure can be read
against it.

* ``BigramLM``: an interpolated Kneser–Ney token bigram (Kneser & Ney 1995; the interpolated form of Chen &
  Goodman 1998, section 3), fitted on a token stream. ``cross_entropy(tokens, block_len, blocks)`` scores exactly the
  predictions that ``token_cache.PackedBlocks`` makes the model train and evaluate on: block ``i`` predicts
  ``tokens[iL + t + 1]`` from what comes before it, for t in 0..L-1, so a bigram predicts it from ``tokens[iL + t]``.
  ``BigramLM.from_pairs`` counts the same model on chosen (previous, next) pairs: ``chat_predictions`` gives
  those of SFT's response-only loss, so a bigram of the training responses scores what 1-SFT's val loss scores.
* ``unigram_cross_entropy``: the add-one unigram on the same predictions (the loss a model has when it has learned
  token frequencies and nothing else).
* ``NaiveBayes``: a multinomial naive Bayes over character unigrams and bigrams with add-alpha smoothing (the
  text-classification baseline of McCallum & Nigam 1998), and ``pair_accuracy``: the share of (chosen, rejected)
  pairs whose chosen text gets the higher log-odds of being good.

Plain numpy and Python counting; nothing is tuned on the split that is scored.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from plumbing.reward import pairs_ranked_right


def block_predictions(tokens, block_len: int, blocks=None):
    """The (context, target) token pairs that ``PackedBlocks(tokens, block_len)`` blocks ``blocks`` predict.

    Args:
        tokens: (N,) token ids, documents already joined with ``[SEP]`` (``PackedBlocks.tokens``).
        block_len: L, predictions per block.
        blocks: block indices (default: every whole block, ``range((N - 1) // L)``).
    Returns:
        (previous, target): two (len(blocks) * L,) int64 arrays; ``target[k]`` follows ``previous[k]``.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if blocks is None:
        blocks = range((len(tokens) - 1) // block_len)
    starts = np.asarray(list(blocks), dtype=np.int64) * block_len  # (nb,)
    positions = (starts[:, None] + np.arange(block_len)[None, :]).reshape(-1)  # (nb * L,)
    return tokens[positions], tokens[positions + 1]


class BigramLM:
    """Interpolated Kneser–Ney bigram with an add-one floor on the lower order.

        P(b | a) = max(c(ab) - D, 0) / c(a·) + D * N1+(a·) / c(a·) * P_low(b)      if a was seen as a history
                 = P_low(b)                                                        otherwise
        P_low(b) = (N1+(·b) + 1) / (N1+(··) + V)

    c(ab) counts the pair in the training stream, c(a·) the pairs that start with a, N1+(a·) the distinct tokens
    seen after a, N1+(·b) the distinct tokens seen before b (the continuation count), N1+(··) the distinct pairs.
    The add-one gives every id of the vocabulary some probability. The discount is Ney et al.'s (1994) estimate
    D = n1 / (n1 + 2 n2) from the numbers of pairs seen once (n1) and twice (n2), computed on the training counts
    only, so nothing is fitted on the scored split.
    """

    def __init__(self, tokens, vocab_size: int, discount: float | None = None):
        tokens = np.asarray(tokens, dtype=np.int64)  # (N,)
        self._fit(tokens[:-1], tokens[1:], vocab_size, discount)

    @classmethod
    def from_pairs(cls, previous, target, vocab_size: int, discount: float | None = None) -> BigramLM:
        """The same model counted on (n,) arrays of (previous token, next token) pairs instead of one stream:
        for SFT, the pairs that predict response tokens only (``chat_predictions``)."""
        lm = cls.__new__(cls)
        lm._fit(np.asarray(previous, dtype=np.int64), np.asarray(target, dtype=np.int64), vocab_size, discount)
        return lm

    def _fit(self, previous, target, vocab_size: int, discount: float | None) -> None:
        self.vocab_size = vocab_size
        keys, counts = np.unique(previous * vocab_size + target, return_counts=True)  # distinct pairs
        self.pair_keys, self.pair_counts = keys, counts  # sorted (P,) and their counts (P,)
        first, second = keys // vocab_size, keys % vocab_size
        self.history_count = np.bincount(first, weights=counts, minlength=vocab_size)  # c(a·), (V,)
        self.followers = np.bincount(first, minlength=vocab_size)  # N1+(a·), (V,)
        continuation = np.bincount(second, minlength=vocab_size)  # N1+(·b), (V,)
        self.low = (continuation + 1.0) / (len(keys) + vocab_size)  # P_low, (V,)
        if discount is None:
            n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
            discount = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5
        self.discount = float(discount)

    def prob(self, previous, target):
        """P(target | previous) for (n,) arrays of ids -> (n,) float64."""
        previous, target = np.asarray(previous, dtype=np.int64), np.asarray(target, dtype=np.int64)
        keys = previous * self.vocab_size + target
        at = np.searchsorted(self.pair_keys, keys).clip(max=len(self.pair_keys) - 1)
        pair = np.where(self.pair_keys[at] == keys, self.pair_counts[at], 0).astype(np.float64)  # c(ab)
        history = self.history_count[previous]  # c(a·)
        seen = history > 0
        safe = np.where(seen, history, 1.0)
        backoff = np.where(seen, self.discount * self.followers[previous] / safe, 1.0)  # weight of P_low
        return np.where(seen, np.maximum(pair - self.discount, 0.0) / safe, 0.0) + backoff * self.low[target]

    def cross_entropy(self, tokens, block_len: int, blocks=None) -> float:
        """Mean -ln P over the predictions of ``block_predictions(tokens, block_len, blocks)``, nats per token."""
        return self.pair_cross_entropy(*block_predictions(tokens, block_len, blocks))

    def pair_cross_entropy(self, previous, target) -> float:
        """Mean -ln P(target | previous) over (n,) arrays of pairs, nats per token."""
        return float(-np.log(self.prob(previous, target)).mean())


def chat_predictions(examples, indices=None):
    """The (previous, target) token pairs that SFT's response-only loss scores in chat examples.

    Args:
        examples: ``(inputs, labels)`` pairs as ``batching.ChatPairs`` holds them (labels already shifted, -100 on
            the prompt); ``indices``: which examples (default: all).
    Returns:
        (previous, target): two (n,) int64 arrays, one entry per label that is not -100: ``target`` is the label,
        ``previous`` the input token at the same position (the ``[ANS]`` before the first response token).
    """
    indices = range(len(examples)) if indices is None else indices
    previous, target = [], []
    for i in indices:
        inputs, labels = examples[i]
        for token, label in zip(inputs, labels):
            if label != -100:
                previous.append(token)
                target.append(label)
    return np.asarray(previous, dtype=np.int64), np.asarray(target, dtype=np.int64)


def unigram_cross_entropy(train_tokens, tokens, block_len: int, vocab_size: int, blocks=None) -> float:
    """Mean -ln P_add-one(target) over the same predictions, with P(b) = (c(b) + 1) / (N + V) from the train
    stream: the plateau a model sits on while it only knows token frequencies."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size)
    _, target = block_predictions(tokens, block_len, blocks)
    return float(-np.log((counts[target] + 1.0) / (counts.sum() + vocab_size)).mean())


def char_features(text: str) -> list[str]:
    """A text's characters and its adjacent character pairs: "好评" -> ["好", "评", "好评"]."""
    return list(text) + [text[i:i + 2] for i in range(len(text) - 1)]


class NaiveBayes:
    """Two-class multinomial naive Bayes over ``char_features`` with add-``alpha`` smoothing.

        log_odds(x) = ln P(good) / P(bad) + sum over features f of x of ln P(f | good) / P(f | bad)
        P(f | class) = (count of f in the class's texts + alpha) / (all feature counts of the class + alpha * |F|)

    F is every feature seen in either class; a feature seen in neither contributes 0 (it is dropped).
    """

    def __init__(self, good_texts, bad_texts, alpha: float = 1.0):
        good = Counter(f for t in good_texts for f in char_features(t))
        bad = Counter(f for t in bad_texts for f in char_features(t))
        features = set(good) | set(bad)
        good_total = sum(good.values()) + alpha * len(features)
        bad_total = sum(bad.values()) + alpha * len(features)
        self.weight = {f: math.log((good[f] + alpha) / good_total) - math.log((bad[f] + alpha) / bad_total)
                       for f in features}
        self.prior = math.log(len(good_texts) / len(bad_texts))

    def log_odds(self, text: str) -> float:
        """ln P(good | text) / P(bad | text) under the model."""
        return self.prior + sum(self.weight.get(f, 0.0) for f in char_features(text))


def pair_accuracy(model: NaiveBayes, pairs) -> float:
    """Share of ``(chosen, rejected)`` text pairs where ``log_odds(chosen) > log_odds(rejected)``, a tie counting
    half (``reward.pairs_ranked_right``, the rule of the RM's and DPO's pair accuracy too)."""
    pairs = list(pairs)
    right = pairs_ranked_right([model.log_odds(c) for c, _ in pairs], [model.log_odds(r) for _, r in pairs])
    return right.item() / len(pairs)


def counting_baselines(tokenizer, pretrain: tuple, sft: tuple, rm: tuple, block_len: int, sft_max_length: int,
                       pretrain_eval_blocks: int, sft_eval_examples: int) -> dict:
    """The counting baselines of the report card, on the stages' own splits and evaluation subsets.

    Args:
        tokenizer: the project tokenizer.
        pretrain, sft, rm: (train files, held-out files) of each stage: 0-PRETRAIN's ``--train_files`` /
            ``--val_files``, 1-SFT's ``--train_files`` / ``--val_files``, 2-RM's ``--train_files`` /
            ``--test_files``.
        block_len: 0-PRETRAIN's block length (``--context_length``); sft_max_length: 1-SFT's ``--max_length``.
        pretrain_eval_blocks, sft_eval_examples: the stages' ``--eval_examples``; the baseline is scored on the
            same ``spread_subset`` the stage evaluates.
    Returns:
        {"bigram_val_loss": nats/token of the Kneser–Ney bigram on pretraining's eval blocks,
         "unigram_val_loss": the add-one unigram on the same predictions,
         "response_bigram_val_loss": nats/token of a Kneser–Ney bigram counted on the SFT training responses'
             predictions, on the response tokens of SFT's eval pairs,
         "naive_bayes_test_accuracy": the character naive Bayes' pair accuracy on the RM's test pairs}.
    """
    from chinese_tokenizer import VOCAB_SIZE
    from plumbing.batching import ChatPairs, spread_subset
    from plumbing.documents import load_text_documents
    from plumbing.records import read_chat_pairs, read_preference_pairs
    from plumbing.token_cache import PackedBlocks

    train = PackedBlocks(load_text_documents(pretrain[0], "--train_files"), tokenizer, block_len, "train")
    val = PackedBlocks(load_text_documents(pretrain[1], "--val_files"), tokenizer, block_len, "val")
    blocks = spread_subset(len(val), pretrain_eval_blocks)

    sft_train = ChatPairs(read_chat_pairs(sft[0], "--train_files"), tokenizer, sft_max_length)
    sft_val = ChatPairs(read_chat_pairs(sft[1], "--val_files"), tokenizer, sft_max_length)
    responses = BigramLM.from_pairs(*chat_predictions(sft_train), VOCAB_SIZE)
    pairs_train = read_preference_pairs(rm[0], "--train_files")
    nb = NaiveBayes([c for _, c, _ in pairs_train], [r for _, _, r in pairs_train])
    return {"bigram_val_loss": BigramLM(train.tokens, VOCAB_SIZE).cross_entropy(val.tokens, block_len, blocks),
            "unigram_val_loss": unigram_cross_entropy(train.tokens, val.tokens, block_len, VOCAB_SIZE, blocks),
            "response_bigram_val_loss": responses.pair_cross_entropy(
                *chat_predictions(sft_val, spread_subset(len(sft_val), sft_eval_examples))),
            "naive_bayes_test_accuracy": pair_accuracy(nb, [(c, r) for _, c, r in
                                                            read_preference_pairs(rm[1], "--test_files")])}
