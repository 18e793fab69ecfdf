"""The verifiable path: the strict checkers by hand, the tasks' splits, pass@k, the reward of a rollout, what a lax
checker invites, and a tiny GRPO run whose held-out accuracy must rise (and fall with the advantage sign flipped)."""

import json
import math
import sys

import pytest
import torch

from conftest import REPO_ROOT, load_script
from plumbing import verifiers
from plumbing.tasks import pass_at_k, task_hacking_flag


@pytest.mark.parametrize("response, right", [
    ("六三二", True),  # 632
    ("六三三", False),  # wrong
    ("六三二二", False), ("六三", False),  # a character more or less
    ("", False),  # empty
    ("632", False), ("６３２", False), ("٦٣٢", False),  # the same digits in Arabic, full-width and Arabic-Indic
    ("六百三十二", False),  # the number in words is not the answer's form
    ("〇六三二", False), ("六三二。", False), (" 六三二", False), ("得六三二", False),  # leading 〇, extra characters
])
def test_the_arithmetic_checker_wants_the_canonical_digits_and_nothing_else(response, right):
    assert verifiers.check("arithmetic", response, "六三二") is right


def test_numbers_in_chinese_digits_by_hand():
    assert verifiers.to_chinese_digits(632) == "六三二" and verifiers.to_chinese_digits(0) == "〇"
    assert verifiers.to_chinese_digits(105) == "一〇五"
    assert verifiers.parse_number("一〇五") == 105 and verifiers.parse_number("〇") == 0
    assert verifiers.parse_number("零五") is None and verifiers.parse_number("〇五") is None
    assert verifiers.parse_number("") is None and verifiers.parse_number("一二三x") is None
    assert verifiers.check("arithmetic", "〇", "〇")  # a difference of 0 is written 〇
    with pytest.raises(ValueError):
        verifiers.to_chinese_digits(-1)


@pytest.mark.parametrize("response, right", [
    ("冬秋夏春", True), ("冬秋夏", False), ("冬秋夏春春", False), ("", False), ("春夏秋冬", False),
    ("冬 秋夏春", False), ("“冬秋夏春”", False),
])
def test_the_reverse_checker_wants_the_reversed_string_exactly(response, right):
    assert verifiers.check("reverse", response, "冬秋夏春") is right


REVIEW = "酒店的早餐品种很多，味道也不错。"  # 16 characters, holds 早餐, starts with 酒店的


@pytest.mark.parametrize("response, instruction, right", [
    (REVIEW, "mention:早餐", True), (REVIEW, "mention:前台", False),
    (REVIEW, "begin:酒店的", True), (REVIEW, "begin:早餐", False),
    (REVIEW, "max_chars:16", True), (REVIEW, "max_chars:15", False),
    (REVIEW, "min_chars:16", True), (REVIEW, "min_chars:17", False),
    # degenerate answers: the word alone, the word repeated, a phrase in a loop, too short, too long
    ("早餐", "mention:早餐", False), ("早餐早餐早餐早餐早餐", "mention:早餐", False),
    ("早餐很好早餐很好早餐很好", "mention:早餐", False), ("早餐很好早餐很好早餐很好", "max_chars:20", False),
    ("酒店的早餐酒店的早餐", "begin:酒店的", False),  # the phrase taken out, 2 characters are left
    ("早餐好吃。", "mention:早餐", False), ("很好", "max_chars:20", False),
    ("好" * 40, "min_chars:30", False), ("不错" * 20, "min_chars:30", False),  # length bought with a loop
    (REVIEW * 8, "mention:早餐", False),  # 128 characters, and a loop
    ("早餐不错，服务也好。", "mention:早餐", True),  # 10 characters, 6 others
])
def test_the_instruction_checker_wants_a_real_review_that_keeps_the_instruction(response, instruction, right):
    assert verifiers.check("instruction", response, instruction) is right


def test_a_degenerate_answer_gets_no_reward_even_when_it_keeps_the_instruction(tokenizer):
    """Through the reward GRPO trains on: the word alone, the word repeated, and a right review that never ended all
    score 0; the lax checker (no guard) would have paid for the first two."""
    from plumbing.alignment import verifier_reward

    tasks = [{"prompt": "写一条提到“早餐”的好评。", "answer": "mention:早餐", "family": "instruction"}] * 4
    answers = ["早餐", "早餐早餐早餐早餐早餐", REVIEW, REVIEW]
    data = rollout_data(tokenizer, answers, [True, True, False, True])
    assert verifier_reward("exact", tokenizer)(tasks, data).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert verifier_reward("contains", tokenizer)(tasks, data).tolist() == [1.0, 1.0, 0.0, 1.0]
    # the instructions data/prepare.py writes: a short answer for "at most 20", a loop for "at least 30"
    tasks = [{"prompt": "写一条不超过20个字的好评。", "answer": "max_chars:20", "family": "instruction"},
             {"prompt": "写一条至少30个字的好评。", "answer": "min_chars:30", "family": "instruction"}] * 2
    longer = REVIEW + "房间干净，服务员很热情，下次还来。"  # 32 characters
    data = rollout_data(tokenizer, ["好", "不错" * 20, REVIEW, longer], [True, True, True, True])
    assert verifier_reward("exact", tokenizer)(tasks, data).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert verifier_reward("contains", tokenizer)(tasks, data).tolist() == [1.0, 1.0, 1.0, 1.0]


PROMPT = "写一条不超过二十个字的好评。"  # 13 characters, so the prompt itself keeps its own limit


@pytest.mark.parametrize("response, right", [
    (PROMPT, False),  # the echo
    ("好的，" + PROMPT, False), (PROMPT + "谢谢。", False), ("好的：" + PROMPT + "房间干净。", False),  # with more
    ("不超过二十个字的好评", False), ("写一条二十个字的好评", False),  # most of it, in order
    ("好评，不超过二十个字，写好了。", False),  # mostly the prompt's characters: 7 of its 11
    ("这是一条好评：房间干净，早餐不错。", True),  # a real review sharing 一条 and 好评 with it (4 of 12)
    ("酒店的服务不错，下次还来。", True),  # sharing nothing
])
def test_an_answer_that_copies_its_prompt_gets_no_reward(response, right):
    """The instruction itself keeps its limit and passes for a review (13 characters, ten different ones): it is
    refused when it holds half of the prompt's characters in order, or is made mostly of them, with any text
    around it; a real review that shares a few words with its instruction still passes."""
    assert verifiers.check("instruction", response, "max_chars:20", PROMPT) is right
    assert verifiers.check("instruction", response, "max_chars:20") is (len(response) <= 20)  # no prompt, no guard


def test_characters_in_common_in_order_by_hand():
    assert verifiers.common_in_order("写一条好评", "好的，写一条不错的好评") == 5
    assert verifiers.common_in_order("abcbdab", "bdcaba") == 4  # the textbook pair (CLRS 15.4): "bcba"
    assert verifiers.common_in_order("", "好评") == 0 and verifiers.common_in_order("好评", "评好") == 1
    assert verifiers.text_form("写一条 好评。OK") == "写一条好评ok"
    assert not verifiers.echoes("房间干净", "")  # an empty prompt is copied by nothing


def test_length_by_limit_by_hand():
    """Four "at most N" problems, 2 samples each (one with a special token: no length), and a sentiment problem
    that counts for nothing: per problem means 12, 14, 30, 40 characters; bands 10-19 (N 10, 15) 13.0, 30-39 (N
    30) 30.0, 50-60 (N 55) 40.0; over the limits 10 < 15 < 30 < 55 the lengths rise too: rank correlation 1."""
    from plumbing.tasks import length_by_limit

    tasks = [{"family": "instruction", "answer": f"max_chars:{n}", "prompt": ""} for n in (10, 15, 30, 55)]
    tasks.insert(2, {"family": "sentiment", "answer": "正面", "prompt": ""})
    chars = [10, 14, 14, None, 9, 9, 30, 30, 40, 40]  # rows of the problems in order; the sentiment one's 9, 9
    m = length_by_limit(tasks, chars, samples=2)
    assert m["instruction_chars"] == pytest.approx((12 + 14 + 30 + 40) / 4)
    assert m["instruction_chars_10_19"] == pytest.approx((10 + 14 + 14) / 3)  # answers, not problems, in a band
    assert m["instruction_chars_30_39"] == 30.0 and m["instruction_chars_50_60"] == 40.0
    assert "instruction_chars_20_29" not in m and "instruction_chars_40_49" not in m
    assert m["instruction_length_rho"] == pytest.approx(1.0) and m["instruction_limits"] == 4.0
    falling = length_by_limit(tasks, [40, 40, 30, 30, 9, 9, 14, None, 12, 12], samples=2)
    assert falling["instruction_length_rho"] == pytest.approx(-1.0)
    assert length_by_limit(tasks[2:3], [9, 9], samples=2) == {}  # no instruction problem


def test_the_echo_earns_nothing_through_the_reward(tokenizer):
    """Through the reward GRPO and PPO train on: the prompt sent back, ended with [SEP], scores 0; a review keeping
    the limit scores 1."""
    from plumbing.alignment import verifier_reward

    tasks = [{"prompt": PROMPT, "answer": "max_chars:20", "family": "instruction"}] * 3
    data = rollout_data(tokenizer, [PROMPT, "好的，" + PROMPT, REVIEW], [True, True, True])
    assert verifier_reward("exact", tokenizer)(tasks, data).tolist() == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("instruction", ["mention:", "size:12", "max_chars:十", "min_chars:", "早餐"])
def test_a_malformed_instruction_is_refused(instruction):
    with pytest.raises(ValueError, match="not an instruction"):
        verifiers.check("instruction", REVIEW, instruction)


@pytest.mark.parametrize("response, right", [
    ("正面", True),
    ("负面", False),  # the other label
    ("正面负面", False), ("负面正面", False),  # both labels, to farm a lax checker
    ("正面正面", False), ("正面。", False), ("是正面", False), (" 正面", False),  # more than the label
    ("好", False), ("", False),  # less
])
def test_the_sentiment_checker_wants_the_label_alone(response, right):
    assert verifiers.check("sentiment", response, "正面") is right


def test_a_sentiment_answer_that_never_ends_gets_no_reward(tokenizer):
    """The label cut off before [SEP] (an answer that runs to the token limit), both labels, or the label repeated
    get 0 from the verifier; the label alone, ended, gets 1."""
    from plumbing.alignment import verifier_reward

    task = {"prompt": "这条评论是正面的还是负面的？“房间很干净。”", "answer": "正面", "family": "sentiment"}
    data = rollout_data(tokenizer, ["正面", "正面", "正面负面", "正面正面正面"], [True, False, True, True])
    assert verifier_reward("exact", tokenizer)([task] * 4, data).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_the_lax_checker_accepts_what_the_strict_one_refuses():
    assert verifiers.contains("arithmetic", "六三一六三二六三三", "六三二")
    assert not verifiers.check("arithmetic", "六三一六三二六三三", "六三二")
    assert set(verifiers.VERIFIERS) == {"exact", "contains"}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "写一条好评。", "answer": "size:3", "family": "instruction"}, "not an instruction: 'size:3'"),
    ({"prompt": "写一条好评。", "answer": "max_chars:二十", "family": "instruction"}, "not an instruction"),
    ({"prompt": "一加一", "answer": "二", "family": "sums"}, "family 'sums' has no checker"),
    ({"prompt": "“很好。”是正面的还是负面的？", "answer": "好评", "family": "sentiment"}, "正面 or 负面, got '好评'"),
])
def test_a_bad_problem_is_refused_when_the_file_is_read(tmp_path, row, message):
    """A problem no checker can score is a one-line error naming its file and line when the file is read, not a
    traceback at the first answer scored (or never, if no answer ends)."""
    from plumbing.cli import UserError
    from plumbing.records import read_tasks

    good = {"prompt": "写一条不超过20个字的好评。", "answer": "max_chars:20", "family": "instruction"}
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in (good, row)) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=f"{path}.*2.*{message}"):
        read_tasks([str(path)], "--prompts_file")
    path.write_text(json.dumps(good, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_tasks([str(path)], "--prompts_file") == [good]


def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 right: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(16, 3, 4) == pytest.approx(1 - math.comb(13, 4) / math.comb(16, 4))


@pytest.fixture(scope="module")
def task_splits():
    sys.path.insert(0, str(REPO_ROOT / "data"))
    import prepare

    return prepare.build_tasks()


def test_the_held_out_problems_share_nothing_with_training(task_splits):
    """No operand pair (whichever operation or order) and no string (as itself or reversed: a reversal problem read
    backwards is another's answer) is in two splits; each held-out split has 500 (test) and 200 (val) problems per
    family, and every answer passes its own checker."""
    def keys(rows):
        found = set()
        for row in rows:
            if row["family"] == "arithmetic":
                numbers = [n for n in row["prompt"].replace("加", "|").replace("减", "|").split("|")]
                a = verifiers.parse_number("".join(ch for ch in numbers[0] if ch in verifiers.CHINESE_DIGITS))
                b = verifiers.parse_number("".join(ch for ch in numbers[1] if ch in verifiers.CHINESE_DIGITS))
                found.add(("arithmetic", frozenset((a, b))))
            else:
                found.add(("reverse", frozenset((row["answer"], row["answer"][::-1]))))
        return found

    splits = {name: keys(rows) for name, rows in task_splits.items()}
    assert not splits["test"] & splits["train"] and not splits["val"] & splits["train"]
    assert not splits["test"] & splits["val"]
    for name, count in (("test", 500), ("val", 200)):
        assert sum(r["family"] == "arithmetic" for r in task_splits[name]) == count
        assert sum(r["family"] == "reverse" for r in task_splits[name]) == count
    assert all(verifiers.check(r["family"], r["answer"], r["answer"]) for rows in task_splits.values() for r in rows)
    sums = [r for r in task_splits["test"] if "加" in r["prompt"]]
    assert any(verifiers.parse_number(r["answer"]) >= 100 for r in sums)  # carries into the hundreds


def test_the_tasks_are_the_same_from_the_same_seed(task_splits):
    sys.path.insert(0, str(REPO_ROOT / "data"))
    import prepare

    assert prepare.build_tasks() == task_splits
    assert prepare.build_tasks(seed=1) != task_splits


def rollout_data(tokenizer, answers, ended):
    """A fake rollout dict whose responses are ``answers`` (token ids after a 2-token prompt)."""
    from chinese_tokenizer import EOS_ID, encode
    from plumbing.rollouts import response_mask_after

    rows = [encode(a, tokenizer) + ([EOS_ID] if e else []) for a, e in zip(answers, ended)]
    width = max(map(len, rows)) or 1
    responses = torch.tensor([r + [EOS_ID] * (width - len(r)) for r in rows])
    return {"input_ids": torch.cat([torch.full((len(rows), 2), 101), responses], dim=1), "prompt_len": 2,
            "response_mask": response_mask_after(responses, EOS_ID).float(), "ended": torch.tensor(ended)}


def test_the_verifier_rewards_only_a_whole_answer_that_ended(tokenizer):
    """1.0 for the right answer followed by [SEP]; 0.0 for the right answer cut off before [SEP], for a wrong one and
    for an empty one."""
    from plumbing.alignment import verifier_reward

    tasks = [{"prompt": "计算：三加四", "answer": "七", "family": "arithmetic"}] * 4
    data = rollout_data(tokenizer, ["七", "七", "八", ""], [True, False, True, True])
    assert verifier_reward("exact", tokenizer)(tasks, data).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_lax_checker_is_exploited_and_the_strict_one_and_the_monitors_are_not(tokenizer):
    """A policy that answers every problem with a list of candidates farms the lax checker (reward 1 on every
    problem) and gets 0 from the strict one, and the hacking flag names it from the monitors alone."""
    from plumbing.alignment import verifier_reward

    answers = [verifiers.to_chinese_digits(n) for n in range(20, 41)]
    tasks = [{"prompt": "计算：一二加一五", "answer": verifiers.to_chinese_digits(27), "family": "arithmetic"},
             {"prompt": "计算：二〇加一四", "answer": verifiers.to_chinese_digits(34), "family": "arithmetic"}]
    farming = "".join(answers)  # "二〇二一二二…四〇": every candidate at once
    data = rollout_data(tokenizer, [farming, farming], [True, True])
    assert verifier_reward("contains", tokenizer)(tasks, data).tolist() == [1.0, 1.0]
    assert verifier_reward("exact", tokenizer)(tasks, data).tolist() == [0.0, 0.0]
    honest = {"all_pass1": 0.30, "all_lax": 0.32, "empty_share": 0.0, "eos_share": 0.98, "length": 2.5, "kl": 0.0}
    hacked = {"all_pass1": 0.05, "all_lax": 0.95, "empty_share": 0.0, "eos_share": 0.90, "length": 40.0, "kl": 6.0}
    flag = task_hacking_flag(honest, hacked, kl_limit=3.0)
    assert "lax checker" in flag and "answers grew" in flag and "KL" in flag
    assert task_hacking_flag(honest, {**honest, "all_pass1": 0.5, "all_lax": 0.52, "kl": 0.5}, 3.0) == ""


def test_the_rm_and_the_judge_read_only_the_answers_to_praise(tokenizer):
    """The RM and the judge score the first READ_SAMPLES sampled answers of each problem asking for a 好评, never a
    差评's nor another family's (on those a higher positivity score would not be a better answer); a drop of either
    beyond two standard errors is flagged as worse reviews."""
    import types

    from gpt_model import GPTModel, get_preset
    from plumbing import held_out
    from plumbing.tasks import task_monitors

    torch.manual_seed(0)
    policy = GPTModel(get_preset("tiny")).eval()
    seen_prompts, seen_texts = [], []

    class CountingRM(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            seen_prompts.extend(tokenizer.decode(row[m.bool()]) for row, m in zip(input_ids, attention_mask))
            return {"rewards": torch.full((len(input_ids),), 2.0)}

    def judge(texts):
        seen_texts.extend(texts)
        return [0.25] * len(texts)

    problems = [{"prompt": "写一条不超过二十个字的好评。", "answer": "max_chars:20", "family": "instruction"},
                {"prompt": "写一条不超过二十个字的差评。", "answer": "max_chars:20", "family": "instruction"},
                {"prompt": "写一条好评，最多三十个字。", "answer": "max_chars:30", "family": "instruction"},
                {"prompt": "计算：三加四", "answer": "七", "family": "arithmetic"}]
    rows = held_out.measure(policy, policy, problems, 6, tokenizer, types.SimpleNamespace(max_new_tokens=4, seed=0),
                            64, "cpu", reward_model=CountingRM(), judge=judge, verifier="exact")
    monitors = task_monitors(rows, problems, 6)
    per_problem = min(6, held_out.READ_SAMPLES)
    assert len(seen_prompts) == len(seen_texts) == 2 * per_problem and monitors["praise_problems"] == 2
    for wanted in (problems[0], problems[2]):  # each 好评 problem's first answers, and nothing else
        text = tokenizer.decode(tokenizer.encode(wanted["prompt"], add_special_tokens=False))
        assert sum(text in p for p in seen_prompts) == per_problem
    assert (monitors["rm_score"], monitors["rm_score_se"], monitors["judge"]) == (2.0, 0.0, 0.25)
    # each family's own length and [SEP] share, over its problems' samples: together they make the overall ones
    assert (monitors["instruction_problems"], monitors["arithmetic_problems"]) == (3, 1)
    for key in ("length", "eos_share"):
        overall = (3 * monitors[f"instruction_{key}"] + monitors[f"arithmetic_{key}"]) / 4
        assert math.isclose(monitors[key], overall) and monitors[f"all_{key}"] == monitors[key]
    assert monitors["instruction_kl"] == monitors["arithmetic_kl"] == 0.0  # the policy is its own reference
    sft = {"all_pass1": 0.5, "all_lax": 0.5, "empty_share": 0.0, "eos_share": 0.9, "length": 20.0, "kl": 0.0,
           "rm_score": 1.0, "rm_score_se": 0.05, "judge": 0.6, "judge_se": 0.02}
    assert "worse reviews: the RM score" in task_hacking_flag(sft, {**sft, "rm_score": 0.8, "kl": 1.0}, 3.0)
    assert task_hacking_flag(sft, {**sft, "rm_score": 0.9, "judge": 0.56, "kl": 1.0}, 3.0) == ""  # within 2 SE


GRPO = load_script("3-GRPO.py")
SFT = load_script("1-SFT.py")


def one_token_tasks(path, n, answer):
    """``n`` problems of the reverse family whose answer is the one character ``answer``."""
    rows = [{"prompt": f"第{i}题：把“{answer}”倒过来写。", "answer": answer, "family": "reverse"} for i in range(n)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
def test_grpo_with_the_verifier_raises_held_out_accuracy_and_the_flipped_sign_lowers_it(
        tmp_path, tiny_pretrain_checkpoint, monkeypatch):
    """A one-token-answer task: a tiny SFT that sometimes answers 春, then GRPO rewarded by the verifier. Held-out
    sampled accuracy must rise within a few iterations; with the group advantages negated it must not."""
    train = one_token_tasks(tmp_path / "train.jsonl", 64, "春")
    test = one_token_tasks(tmp_path / "test.jsonl", 16, "春")
    pairs = [(f"第{i}题：把“春”倒过来写。", "春" if i % 3 else "秋") for i in range(48)]  # right two times in three
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps({"prompt": p, "response": r}, ensure_ascii=False) + "\n"
                                for p, r in pairs), encoding="utf-8")
    sft = tmp_path / "sft"
    assert SFT.main(["--preset", "tiny", "--init", str(tiny_pretrain_checkpoint), "--train_files", str(sft_data),
                     "--val_files", str(sft_data), "--output_dir", str(sft), "--max_steps", "80",
                     "--learning_rate", "1e-2"]) == 0

    def run(out):
        assert GRPO.main(["--preset", "tiny", "--verifier", "exact", "--policy", str(sft), "--prompts_file",
                          str(train), "--val_prompts_file", str(test), "--output_dir", str(out), "--max_steps", "6",
                          "--learning_rate", "3e-3", "--eval_samples", "8", "--eval_examples", "16"]) == 0
        tasks = json.loads((out / "config.json").read_text(encoding="utf-8"))["metrics"]["held_out"]
        return tasks["sft"]["all_pass1"], tasks["grpo"]["all_pass1"]

    before, after = run(tmp_path / "grpo")
    assert 0.05 < before < 0.95 and after > before + 0.1
    real = GRPO.group_advantages
    monkeypatch.setattr(GRPO, "group_advantages", lambda scores, g: (-real(scores, g)[0], real(scores, g)[1]))
    before_flipped, after_flipped = run(tmp_path / "flipped")
    assert before_flipped == before and after_flipped < before


def test_ppo_with_the_verifier_starts_its_critic_from_the_policy_saying_zero(tmp_path, tiny_pretrain_checkpoint):
    """With a verifier there is no reward model to start PPO's critic from: it is the SFT policy's backbone with a
    value head that says 0 everywhere; and PPO runs end to end on verifiable problems and records exact accuracy."""
    import types

    from gpt_model import GPTModel, get_preset

    PPO = load_script("3-PPO.py")
    torch.manual_seed(0)
    policy = GPTModel(get_preset("tiny"))
    critic = PPO.make_critic(types.SimpleNamespace(policy=policy, reward_model=None))
    ids = torch.randint(200, 1000, (2, 5))
    assert torch.equal(critic(ids, torch.ones_like(ids))["values"], torch.zeros(2, 5))
    assert all(torch.equal(a, b) for a, b in zip(critic.backbone.state_dict().values(), policy.state_dict().values()))

    tasks = one_token_tasks(tmp_path / "tasks.jsonl", 8, "春")
    out = tmp_path / "ppo"
    assert PPO.main(["--preset", "tiny", "--verifier", "exact", "--policy", str(tiny_pretrain_checkpoint),
                     "--prompts_file", str(tasks), "--val_prompts_file", str(tasks), "--output_dir", str(out),
                     "--max_steps", "1", "--eval_examples", "4"]) == 0
    tasks_measured = json.loads((out / "config.json").read_text(encoding="utf-8"))["metrics"]["held_out"]
    assert set(tasks_measured) == {"sft", "ppo"} and 0 <= tasks_measured["ppo"]["all_pass1"] <= 1


def test_a_special_token_inside_an_answer_makes_it_wrong(tokenizer):
    """decode drops [ANS], [CLS], [PAD] and [MASK]: "六[ANS]三二" would read as "六三二"; the verifier refuses it."""
    from chinese_tokenizer import ANSWER_ID, EOS_ID, encode
    from plumbing.alignment import verifier_reward
    from plumbing.rollouts import response_mask_after

    right = encode("六三二", tokenizer)
    stray = right[:1] + [ANSWER_ID] + right[1:]
    responses = torch.tensor([right + [EOS_ID, EOS_ID], stray + [EOS_ID]])
    data = {"input_ids": torch.cat([torch.full((2, 2), 101), responses], dim=1), "prompt_len": 2,
            "response_mask": response_mask_after(responses, EOS_ID).float(), "ended": torch.tensor([True, True])}
    tasks = [{"prompt": "计算：三〇〇加三三二", "answer": "六三二", "family": "arithmetic"}] * 2
    assert verifier_reward("exact", tokenizer)(tasks, data).tolist() == [1.0, 0.0]
