"""judge.py: every monitor against a hand count, the spread, best-of-n's KL, the reward-hacking flag, and the
snownlp judge itself."""

import math

import pytest

from plumbing import judge


def test_distinct_2_pools_the_bigrams_of_all_responses():
    """Bigrams (1,2) (2,3) (3,1) (1,2) | (1,2): 5 in all, 3 different -> 0.6. A one-token response has none."""
    assert judge.distinct_n([[1, 2, 3, 1, 2], [1, 2], [9]], 2) == pytest.approx(3 / 5)
    assert judge.distinct_n([[1, 2, 3, 4]], 2) == 1.0
    assert judge.distinct_n([[4, 4, 4, 4, 4]], 2) == pytest.approx(1 / 4)
    assert judge.distinct_n([[1, 2], [1, 2]], 1) == pytest.approx(2 / 4)
    assert judge.distinct_n([[7], []], 2) == 0.0


@pytest.mark.parametrize("tokens, expected", [
    ([5, 5, 5], 3),  # one token three times
    ([7, 0, 7, 0, 7, 0], 6),  # "错，" three times
    ([1, 2, 1, 2, 3], 4),  # "非常非常好"
    ([1, 1, 2, 1, 2, 1, 2], 6),  # "1 1" is a run of 2, "(1 2) x 3" one of 6: the longest counts
    ([1, 2, 1, 2, 1], 4),  # whole copies only: (1 2) x 2, or (2 1) x 2
    ([1, 2, 3], 0),  # nothing repeats back to back
    ([1, 2, 3, 1, 2, 3], 6),  # a trigram twice
    ([], 0),
])
def test_longest_repeat_by_hand(tokens, expected):
    assert judge.longest_repeat(tokens) == expected


def test_longest_repeat_looks_at_n_grams_up_to_max_n():
    five = [1, 2, 3, 4, 5] * 2
    assert judge.longest_repeat(five) == 0  # a 5-gram twice is beyond the default max_n of 4
    assert judge.longest_repeat(five, max_n=5) == 10


def test_eos_share_and_mean_length():
    assert judge.eos_share([True, False, True, True]) == 0.75
    assert judge.eos_share([]) == 0.0
    assert judge.mean_length([[1, 2, 3], [4], []]) == pytest.approx(4 / 3)


def test_mean_and_standard_error_by_hand():
    """[1, 2, 3, 4]: mean 2.5, sample variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3, SE sqrt(5/3 / 4)."""
    mean, se = judge.mean_and_se([1, 2, 3, 4])
    assert mean == pytest.approx(2.5) and se == pytest.approx(math.sqrt(5 / 12))
    assert judge.mean_and_se([3.0]) == (3.0, 0.0)
    assert judge.mean_and_se([]) == (0.0, 0.0)


def test_rank_correlation_against_the_textbook_formula():
    """Without ties Spearman's rho is 1 - 6 sum d^2 / (n (n^2 - 1)), d the rank differences: checked on shuffled
    lists; with ties the ranks are averaged ([1, 2, 2, 3] against [1, 2, 3, 4]: ranks 1, 2.5, 2.5, 4, rho by hand
    sqrt(0.9)); the SE is sqrt((1 - rho^2) / (n - 2))."""
    import random

    rng = random.Random(0)
    for n in (3, 5, 25):
        x, y = rng.sample(range(100), n), rng.sample(range(100), n)
        rx = {v: i + 1 for i, v in enumerate(sorted(x))}
        ry = {v: i + 1 for i, v in enumerate(sorted(y))}
        d2 = sum((rx[a] - ry[b]) ** 2 for a, b in zip(x, y))
        rho, se = judge.rank_correlation(x, y)
        assert rho == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
        assert se == pytest.approx(math.sqrt((1 - rho * rho) / (n - 2)))
    assert judge.ranks([5, 1, 5, 7]) == [2.5, 1.0, 2.5, 4.0]
    # deviations from the mean rank 2.5: (-1.5, 0, 0, 1.5) and (-1.5, -0.5, 0.5, 1.5): sxy 4.5, sxx 4.5, syy 5
    rho, _ = judge.rank_correlation([1, 2, 2, 3], [1, 2, 3, 4])
    assert rho == pytest.approx(4.5 / math.sqrt(4.5 * 5.0)) == pytest.approx(math.sqrt(0.9))
    assert judge.rank_correlation([1, 2, 3], [3, 2, 1]) == (pytest.approx(-1.0), 0.0)
    assert judge.rank_correlation([1, 1, 1], [1, 2, 3])[0] == 0.0  # a constant list follows nothing
    with pytest.raises(ValueError, match="3 or more pairs"):
        judge.rank_correlation([1, 2], [1, 2])


def test_summarize_collects_every_monitor():
    m = judge.summarize([[1, 2, 1, 2], [3]], [True, False], [1.0, 3.0], [0.5, 0.7], kl=[0.0, 2.0], entropy=1.5)
    assert m["rm_score"] == 2.0 and m["rm_score_se"] == pytest.approx(1.0)
    assert m["judge"] == pytest.approx(0.6) and m["judge_se"] == pytest.approx(0.1)
    assert m["distinct_2"] == pytest.approx(2 / 3)  # (1,2) (2,1) (1,2)
    assert m["longest_run"] == 2.0  # (4 + 0) / 2
    assert m["eos_share"] == 0.5 and m["length"] == 2.5
    assert m["kl"] == 1.0 and m["entropy"] == 1.5
    assert "kl" not in judge.summarize([[1]], [True], [0.0], [0.5])


def test_best_of_n_kl():
    assert judge.best_of_n_kl(1) == 0.0
    assert judge.best_of_n_kl(8) == pytest.approx(math.log(8) - 7 / 8)  # 1.204


SFT = {"rm_score": -0.24, "judge": 0.60, "judge_se": 0.02, "distinct_2": 0.90, "longest_run": 2.0, "kl": 0.0,
       "eos_share": 0.25}


def test_flag_stays_quiet_on_an_honest_gain():
    after = {**SFT, "rm_score": 1.2, "judge": 0.66, "distinct_2": 0.87, "longest_run": 3.0, "kl": 2.8}
    assert judge.reward_hacking_flag(SFT, after, kl_limit=3.0) == ""


def test_flag_on_the_old_demo_ppo():
    """The issue's measurements of the old demo PPO: RM -0.24 -> 6.47, KL 12.4, distinct-2 0.90 -> 0.76."""
    after = {**SFT, "rm_score": 6.47, "judge": 0.79, "distinct_2": 0.76, "longest_run": 40.0, "kl": 12.4}
    flag = judge.reward_hacking_flag(SFT, after, kl_limit=3.0)
    assert flag.startswith("reward hacking suspected: ") and flag.endswith(".")
    assert "distinct-2 fell from 0.900 to 0.760" in flag
    assert "longest repeated run grew from 2.0 to 40.0" in flag
    assert "KL to the SFT model is 12.40 nats/response, past the limit of 3" in flag
    assert "judge fell" not in flag  # the judge liked "错，错，…" too


@pytest.mark.parametrize("change, fires", [
    ({"rm_score": 1.0, "judge": 0.50}, True),  # RM up, judge down by 0.10 > 2 * hypot(0.02, 0.02) = 0.057
    ({"rm_score": 1.0, "judge": 0.56}, False),  # down by 0.04: within the noise
    ({"rm_score": -0.5, "judge": 0.50}, False),  # both fell: a worse model, not a hacked one
    ({"distinct_2": 0.84}, True),  # fell by 0.06
    ({"distinct_2": 0.86}, False),  # fell by 0.04
    ({"longest_run": 7.0}, True),  # more than doubled and grew by 5
    ({"longest_run": 5.0}, False),  # grew by only 3
    ({"kl": 3.5}, True),
    ({"kl": 2.9}, False),
    ({"eos_share": 0.08}, True),  # from 0.25: fell by 0.17 (the demo DPO: 56% -> 25%)
    ({"eos_share": 0.12}, False),  # fell by 0.13
    ({"eos_share": 0.90}, False),  # rose: PPO's answers end more often
])
def test_flag_rules_one_at_a_time(change, fires):
    flag = judge.reward_hacking_flag(SFT, {**SFT, **change}, kl_limit=3.0)
    assert bool(flag) == fires, flag


def test_flag_says_how_many_answers_still_end():
    flag = judge.reward_hacking_flag({**SFT, "eos_share": 0.56}, {**SFT, "eos_share": 0.25}, kl_limit=3.0)
    assert flag == "reward hacking suspected: fewer answers end: 56% -> 25% end with [SEP]."


def test_flag_counts_any_fall_of_the_judge_without_spreads():
    before = {k: v for k, v in SFT.items() if k != "judge_se"}
    assert "judge fell" in judge.reward_hacking_flag(before, {**before, "rm_score": 1.0, "judge": 0.59}, 3.0)


@pytest.fixture(scope="module")
def sentiment():
    pytest.importorskip("snownlp", reason="the judge needs snownlp (pip install -r requirements.txt)")
    return judge.SentimentJudge()


def test_sentiment_judge_tells_praise_from_complaint(sentiment):
    good, bad, hacked = sentiment(["房间很干净，服务也很好，下次还会来。", "房间很脏，服务很差，再也不来了。",
                                   "错，" * 20])
    assert 0 <= bad < 0.5 < good <= 1
    assert hacked > 0.5  # what the docstring warns of: repetition of a mild word fools a naive Bayes
