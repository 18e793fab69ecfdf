"""Tests for 3-DPO.py: the DPO loss by hand, response-only sequence log-probs against a loop, and a tiny end-to-end
run (it learns an easy preference, writes a GPT checkpoint, resumes exactly)."""

import json
import math

import pytest
import torch
from test_rm import easy_pairs, write_jsonl

from conftest import load_script
from plumbing.checkpoint import load_checkpoint
from plumbing.rollouts import sequence_logprobs

DPO = load_script("3-DPO.py")


def test_dpo_loss_by_hand():
    # policy log-probs -1 (chosen), -2 (rejected); reference -1.5 for both; beta 0.5
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    loss, chosen, rejected = DPO.dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert chosen.item() == pytest.approx(0.25) and rejected.item() == pytest.approx(-0.25)  # 0.5 * (+-0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.5)))  # -log sigmoid(0.5 * margin 1.0)
    # IPO regresses the margin (1.0) to 1 / (2 beta) = 1.0: no loss left
    assert DPO.dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(0.0)
    assert DPO.dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type="ipo")[0].item() == pytest.approx((1.0 - 2.0) ** 2)
    # policy == reference: every pair ties, the loss is log 2
    assert DPO.dpo_loss(pc, pr, pc, pr, beta=0.1)[0].item() == pytest.approx(math.log(2))


def test_dpo_gradient_raises_chosen_over_rejected():
    pc, pr = torch.tensor([-3.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    loss, _, _ = DPO.dpo_loss(pc, pr, torch.tensor([-3.0]), torch.tensor([-3.0]), beta=0.1)
    loss.backward()
    # d/dh of -log sigmoid(beta h) at h = 0 is -beta / 2: chosen up, rejected down, equally
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)


def test_sequence_logprobs_sum_only_the_labelled_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.tensor([[-100, 3, 5, -100], [-100, -100, 6, 0]])
    expected = []
    for b in range(2):
        total = 0.0
        for t in range(4):
            if labels[b, t] != -100:
                total += torch.log_softmax(logits[b, t], -1)[labels[b, t]].item()
        expected.append(total)
    assert sequence_logprobs(logits, labels).tolist() == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_data")
    return {"train": write_jsonl(d / "train.jsonl", easy_pairs(48, 0)), "val": write_jsonl(d / "val.jsonl",
                                                                                           easy_pairs(16, 1))}


def dpo_args(pairs, models, prompts, out, *extra):
    policy, rm = models
    return ["--preset", "tiny", "--policy", str(policy), "--reward", str(rm), "--val_prompts_file", str(prompts),
            "--train_files", pairs["train"], "--val_files", pairs["val"], "--output_dir", str(out), "--max_steps", "8",
            "--eval_every", "4", "--max_new_tokens", "8", *map(str, extra)]


@pytest.mark.slow
def test_dpo_learns_an_easy_preference_and_writes_a_gpt(tmp_path, pairs, tiny_policy_and_rm, prompts):
    out = tmp_path / "dpo"
    assert DPO.main(dpo_args(pairs, tiny_policy_and_rm, prompts, out, "--learning_rate", "1e-3")) == 0
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert config["stage"] == "dpo" and config["model_type"] == "gpt" and config["beta"] == 0.1
    assert rows[0]["step"] == 0 and rows[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == ref
    assert rows[0]["val_accuracy"] == 0.5  # every margin is 0: a tie counts half
    assert config["metrics"]["val_accuracy"] > 0.8 and config["metrics"]["val_margin"] > 0
    assert config["metrics"]["val_loss"] < math.log(2)
    model, _, _ = load_checkpoint(str(out), "gpt")  # generate.py and the report read it as any language model
    assert (out / "curves.png").is_file() and (out / "samples.md").is_file() and not (out / "state").exists()
    # the held-out monitors PPO and GRPO report: the SFT policy before (its own reference: KL 0) and DPO after
    held = config["metrics"]["held_out"]
    assert set(held) == {"sft", "dpo"} and {"rm_score", "judge", "kl", "distinct_2", "eos_share"} <= set(held["dpo"])
    assert held["sft"]["kl"] == pytest.approx(0.0, abs=1e-6) and held["dpo"]["kl"] > 0
    assert "loss" not in held["sft"] and "accuracy" not in held["sft"]  # pair metrics are not held-out monitors
    assert config["metrics"]["kl"] == pytest.approx(held["dpo"]["kl"], abs=1e-4)


def test_dpo_reads_conversation_pairs_as_the_same_examples(tmp_path, pairs, tokenizer):
    """chosen/rejected conversations go through the template exactly like the flat pairs they hold."""
    from plumbing.records import read_preference_pairs

    flat = read_preference_pairs(pairs["train"], "--train_files")
    rows = [{"chosen": [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
             "rejected": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]} for p, c, r in flat]
    conversations = read_preference_pairs(write_jsonl(tmp_path / "conv.jsonl", rows), "--train_files")
    assert conversations[0][0] == (("user", flat[0][0]),)
    assert DPO.encode_pairs(conversations, tokenizer, 64) == DPO.encode_pairs(flat, tokenizer, 64)


@pytest.mark.slow
def test_dpo_resume_is_bit_identical(tmp_path, pairs, tiny_policy_and_rm, prompts):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert DPO.main(dpo_args(pairs, tiny_policy_and_rm, prompts, straight)) == 0
    assert DPO.main(dpo_args(pairs, tiny_policy_and_rm, prompts, halves, "--stop_after", "3")) == 0
    assert (halves / "state").is_dir()
    assert DPO.main(dpo_args(pairs, tiny_policy_and_rm, prompts, halves, "--resume")) == 0
    assert (straight / "model.safetensors").read_bytes() == (halves / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_the_three_aligners_measure_the_same_sft_policy(tmp_path, pairs, tiny_policy_and_rm, prompts):
    """PPO, DPO and GRPO sample the SFT policy on the held-out prompts with one seed and one batch size, whatever
    their own rollout sizes: the report's single SFT row is each stage's SFT row, to the last digit."""
    policy, rm = tiny_policy_and_rm
    common = ["--preset", "tiny", "--policy", str(policy), "--reward", str(rm), "--val_prompts_file", str(prompts),
              "--max_new_tokens", "8", "--eval_examples", "4", "--max_steps", "1"]
    online = ["--prompts_file", str(prompts)]
    assert DPO.main([*common, "--train_files", pairs["train"], "--val_files", pairs["val"], "--output_dir",
                     str(tmp_path / "dpo")]) == 0
    assert load_script("3-GRPO.py").main([*common, *online, "--rollout_size", "2", "--output_dir",
                                          str(tmp_path / "grpo")]) == 0
    assert load_script("3-PPO.py").main([*common, *online, "--rollout_size", "3", "--output_dir",
                                         str(tmp_path / "ppo")]) == 0
    sft = [json.loads((tmp_path / stage / "config.json").read_text(encoding="utf-8"))["metrics"]["held_out"]["sft"]
           for stage in ("dpo", "grpo", "ppo")]
    assert sft[0] == sft[1] == sft[2] and sft[0]["kl"] == 0.0


def test_chosen_and_rejected_share_the_same_prompt_ids(tokenizer):
    """A pair longer than max_length is cut once: the prompt, identically on both sides, for the longer answer; then
    only the end of an answer that alone does not fit. (Each side used to be cut on its own: 11 prompt ids on one
    side, 8 on the other.)"""
    from chinese_tokenizer import ANSWER_ID, CLS_ID, SEP_ID, encode

    prompt, chosen, rejected = "请" * 30, "好" * 10, "差" * 24
    (c_in, c_labels), (r_in, r_labels) = DPO.encode_pairs([(prompt, chosen, rejected)], tokenizer, 32)[0][0]
    c_prompt, r_prompt = c_in[:c_in.index(ANSWER_ID) + 1], r_in[:r_in.index(ANSWER_ID) + 1]
    assert c_prompt == r_prompt and c_prompt[0] == CLS_ID
    assert len(r_in) + 1 == 33  # the rejected side fills the 32 positions (+ its last label)
    assert c_in[len(c_prompt):] + [c_labels[-1]] == encode(chosen, tokenizer) + [SEP_ID]  # the short answer is whole
    assert len(c_prompt) == 33 - len(encode(rejected, tokenizer) + [SEP_ID])  # the prompt gave way for the longer one
    encoded, cut, dropped = DPO.encode_pairs([(prompt, chosen, rejected), ("短", "好", "差")], tokenizer, 32)
    assert (cut, dropped, len(encoded)) == (1, 0, 2)
    # an answer longer than everything: the prompt keeps [CLS], one token and [ANS]; the answers lose their ends
    (c_in, _), (r_in, _) = DPO.encode_pairs([(prompt, "好" * 50, rejected)], tokenizer, 32)[0][0]
    assert c_in[:3] == r_in[:3] and c_in[2] == ANSWER_ID and len(c_in) == 32


@pytest.mark.slow
def test_step_0_is_exactly_log_2_whatever_the_dropout(tmp_path, pairs, tiny_policy_and_rm, prompts, tokenizer):
    """With drop_rate 0.1 in the policy's config, the first training step's loss is exactly log 2 and its implicit
    rewards are 0: both forwards run without dropout (it used to read 0.6807)."""
    from plumbing.checkpoint import save_checkpoint

    policy_dir, rm = tiny_policy_and_rm
    model, _, config = load_checkpoint(str(policy_dir), "gpt")
    dropout = type(model)(model.cfg.replace(drop_rate=0.1))
    dropout.load_state_dict(model.state_dict())
    save_checkpoint(str(tmp_path / "sft-dropout"), dropout, tokenizer, {"stage": "sft"})
    out = tmp_path / "dpo"
    assert DPO.main(dpo_args(pairs, (tmp_path / "sft-dropout", rm), prompts, out, "--max_steps", "2")) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows[1]["step"] == 1 and rows[1]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[1]["train_accuracy"] == 0.5  # every implicit reward 0: every pair a tie


def test_the_default_held_out_prompts_are_the_preference_paths():
    """Run with no flags (as the pipeline runs it), DPO measures on data/ppo/val_prompts.jsonl; PPO and GRPO too, and
    with --verifier on the review instructions' test split."""
    assert DPO.parse_args([]).val_prompts_file.endswith("data/ppo/val_prompts.jsonl")
    for script in ("3-PPO.py", "3-GRPO.py"):
        stage = load_script(script)
        assert stage.parse_args([]).val_prompts_file.endswith("data/ppo/val_prompts.jsonl")
        tasks = stage.parse_args(["--verifier", "exact"])
        assert tasks.val_prompts_file.endswith("data/instructions/test.jsonl")
        assert tasks.prompts_file.endswith("data/instructions/train.jsonl") and tasks.output_dir.endswith("-tasks")
