"""The counting baselines against values worked out by hand on tiny inputs."""

import math

import numpy as np
import pytest

from plumbing.baselines import (
    BigramLM,
    NaiveBayes,
    block_predictions,
    char_features,
    pair_accuracy,
    unigram_cross_entropy,
)


def test_block_predictions_are_the_packed_blocks_next_token_pairs():
    """Block i of length L predicts tokens[iL+t+1] from tokens[iL+t]; the tail past the last whole block is unused."""
    tokens = [0, 1, 2, 3, 1]  # (5 - 1) // 2 = 2 blocks of 2 predictions
    previous, target = block_predictions(tokens, 2)
    assert previous.tolist() == [0, 1, 2, 3] and target.tolist() == [1, 2, 3, 1]
    previous, target = block_predictions(tokens, 2, blocks=[1])
    assert previous.tolist() == [2, 3] and target.tolist() == [3, 1]


def test_kneser_ney_bigram_by_hand():
    """Train [1 2 1 3 1 2], V = 4: pairs 12 x2, 21, 13, 31 -> n1 = 3, n2 = 1, D = 3 / (3 + 2) = 0.6.
    Continuation counts N1+(.b) = (0, 2, 1, 1) over 4 distinct pairs -> P_low = (1, 3, 2, 2) / 8.
    P(2|1) = (2 - 0.6)/3 + 0.6 * 2/3 * 2/8 = 17/30;  P(0|1) = 0.4 * 1/8;  P(3|2) = 0.6 * 2/8;  P(1|0) = P_low(1)."""
    lm = BigramLM([1, 2, 1, 3, 1, 2], vocab_size=4)
    assert lm.discount == pytest.approx(0.6)
    assert lm.prob([1, 1, 2, 0], [2, 0, 3, 1]) == pytest.approx([17 / 30, 0.05, 0.15, 3 / 8])
    assert lm.prob([1] * 4, [0, 1, 2, 3]).sum() == pytest.approx(1.0)  # a seen history: a distribution
    assert lm.prob([0] * 4, [0, 1, 2, 3]).sum() == pytest.approx(1.0)  # an unseen one: P_low
    # val [1 2 3], one block of 2 predictions: 1 -> 2 and 2 -> 3
    assert lm.cross_entropy([1, 2, 3], 2) == pytest.approx(-(math.log(17 / 30) + math.log(0.15)) / 2)


def test_add_one_unigram_by_hand():
    """Train counts (0, 3, 2, 1) of 6 tokens, V = 4: P(b) = (c(b) + 1) / 10; val [1 2 3] predicts 2 and 3."""
    ce = unigram_cross_entropy([1, 2, 1, 3, 1, 2], [1, 2, 3], 2, vocab_size=4)
    assert ce == pytest.approx(-(math.log(3 / 10) + math.log(2 / 10)) / 2)


def test_naive_bayes_by_hand():
    """good ["好好"] -> 好 x2, 好好 x1; bad ["差"] -> 差 x1; |F| = 3, add-one: good total 3 + 3, bad total 1 + 3.
    w(好) = ln(3/6) - ln(1/4) = ln 2, w(好好) = ln(2/6) - ln(1/4) = ln 4/3, w(差) = ln(1/6) - ln(2/4) = ln 1/3."""
    assert char_features("好评") == ["好", "评", "好评"]
    nb = NaiveBayes(["好好"], ["差"])
    assert nb.weight == pytest.approx({"好": math.log(2), "好好": math.log(4 / 3), "差": math.log(1 / 3)})
    assert nb.log_odds("好差") == pytest.approx(math.log(2 / 3))  # the unseen pair 好差 counts 0
    # right, wrong, and a tie (both unseen), which counts as wrong
    assert pair_accuracy(nb, [("好", "差"), ("差", "好"), ("x", "y")]) == pytest.approx(1.5 / 3)


def test_bigram_accepts_numpy_int32_tokens():
    """PackedBlocks.tokens is int32: pair keys must not overflow (21128^2 > 2^31)."""
    tokens = np.array([21127, 21126, 21127, 21126, 21127], dtype=np.int32)  # two pairs, each seen twice: D = 0
    lm = BigramLM(tokens, vocab_size=21128)
    assert lm.discount == 0.0 and lm.prob([21127], [21126])[0] == pytest.approx(1.0)


def test_response_bigram_counts_only_response_predictions():
    """Two chat examples (labels shifted, -100 on the prompt): only positions with a label become pairs, and a
    bigram counted on them equals one counted by hand on the same pairs."""
    from plumbing.baselines import chat_predictions

    examples = [([5, 6, 7, 8], [-100, -100, 8, 9]),  # [CLS]=5 prompt=6 [ANS]=7 response 8, [SEP]=9
                ([5, 7, 8], [-100, 8, 9])]  # an empty prompt
    previous, target = chat_predictions(examples)
    assert previous.tolist() == [7, 8, 7, 8] and target.tolist() == [8, 9, 8, 9]
    assert chat_predictions(examples, [1])[0].tolist() == [7, 8]
    # pairs 7->8 x2 and 8->9 x2: no pair seen once, so D = 0 and P(8|7) = P(9|8) = 1 exactly
    lm = BigramLM.from_pairs(previous, target, vocab_size=10)
    assert lm.discount == 0.0 and lm.pair_cross_entropy([7, 8], [8, 9]) == pytest.approx(0.0)
    # the pairs of a stream give exactly what the stream constructor counts
    by_stream = BigramLM([1, 2, 1, 3, 1, 2], vocab_size=4)
    by_pairs = BigramLM.from_pairs([1, 2, 1, 3, 1], [2, 1, 3, 1, 2], vocab_size=4)
    assert by_pairs.discount == by_stream.discount
    assert by_pairs.prob([1, 1, 2, 0], [2, 0, 3, 1]) == pytest.approx(by_stream.prob([1, 1, 2, 0], [2, 0, 3, 1]))
