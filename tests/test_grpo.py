"""Tests for 3-GRPO.py: group advantages, the k3 KL estimator and the GRPO loss by hand, and a tiny end-to-end run
(it writes a GPT checkpoint with the held-out monitors, and resumes exactly)."""

import json
import math

import pytest
import torch

from conftest import load_script

GRPO = load_script("3-GRPO.py")


def test_group_advantages_by_hand():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 5.0])  # three groups of two
    adv = GRPO.group_advantages(scores, 2)
    # group (1, 3): mean 2, unbiased std sqrt(2); group (2, 2) and (5, 5): no spread, no advantage
    assert adv.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0, 0, 0, 0], abs=1e-5)
    adv4 = GRPO.group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), 4)  # mean 1.5, std sqrt(5/3)
    assert adv4.tolist() == pytest.approx([(v - 1.5) / math.sqrt(5 / 3) for v in range(4)], abs=1e-5)


def test_k3_is_never_negative_and_unbiased():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -2.0])
    k3 = GRPO.kl_k3(logp, ref)
    by_hand = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp.tolist(), ref.tolist())]
    assert k3.tolist() == pytest.approx(by_hand) and k3[0].item() == 0 and (k3 >= 0).all()
    # its mean over tokens drawn from pi is KL(pi || pi_ref), computed exactly here
    pi, pi_ref = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.3, 0.3, 0.4])
    exact = (pi * (pi / pi_ref).log()).sum().item()
    expectation = (pi * GRPO.kl_k3(pi.log(), pi_ref.log())).sum().item()
    assert expectation == pytest.approx(exact, rel=1e-5)


def test_grpo_loss_at_ratio_one_is_the_policy_gradient_plus_kl():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    old = logp.detach().clone()
    ref = torch.tensor([[-1.0, -1.0, 0.0], [-0.5, -1.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the first response has 2 tokens, the second 3
    adv = torch.tensor([2.0, -1.0])
    loss, clip_fraction, kl = GRPO.grpo_loss(logp, old, ref, adv, mask, cliprange=0.2, beta=0.5)
    k3 = GRPO.kl_k3(old, ref)
    per_seq = [(-(2.0) * 2 + 0.5 * (k3[0, 0] + k3[0, 1])) / 2, (-(-1.0) * 3 + 0.5 * k3[1].sum()) / 3]
    assert loss.item() == pytest.approx(((per_seq[0] + per_seq[1]) / 2).item())
    assert clip_fraction.item() == 0
    assert kl.item() == pytest.approx(((k3 * mask).sum() / mask.sum()).item())
    loss.backward()
    # per token, d/d logp of -A * ratio at ratio 1 is -A, and of beta * k3 it is beta * (1 - exp(ref - logp));
    # each response's mean divides by its length |o|, the mean over the 2 responses by 2
    expected = (-adv[:, None] + 0.5 * (1 - torch.exp(ref - old))) / mask.sum(1, keepdim=True) / 2
    assert torch.allclose(logp.grad, expected * mask, atol=1e-6)


def grpo_args(models, out, prompts, *extra):
    policy, rm = models
    return ["--preset", "tiny", "--policy", str(policy), "--reward", str(rm), "--prompts_file", str(prompts),
            "--val_prompts_file", str(prompts), "--output_dir", str(out), "--max_new_tokens", "8",
            "--eval_examples", "4", *map(str, extra)]


@pytest.mark.slow
def test_prompts_as_alpaca_or_messages_records_train_the_same_policy(tmp_path, tiny_policy_and_rm, prompts):
    """The same prompts as alpaca records and as whole "messages" conversations (whose last, assistant, turn is
    dropped) give the byte-identical GRPO policy; multi-turn prompts run through the same template."""
    rows = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()]
    alpaca, messages, multi = tmp_path / "alpaca.jsonl", tmp_path / "messages.json", tmp_path / "multi.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": r["prompt"], "input": "", "output": "x"},
                                         ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    messages.write_text(json.dumps([{"messages": [{"role": "user", "content": r["prompt"]},
                                                  {"role": "assistant", "content": "好"}]} for r in rows],
                                   ensure_ascii=False), encoding="utf-8")
    multi.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "你好"},
                                                      {"role": "assistant", "content": "你好！"},
                                                      {"role": "user", "content": r["prompt"]}]},
                                        ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    models = {}
    for name, path in (("ours", prompts), ("alpaca", alpaca), ("messages", messages), ("multi", multi)):
        out = tmp_path / name
        assert GRPO.main(grpo_args(tiny_policy_and_rm, out, path, "--max_steps", "2")) == 0
        models[name] = (out / "model.safetensors").read_bytes()
    assert models["alpaca"] == models["ours"] and models["messages"] == models["ours"]
    assert models["multi"] != models["ours"]  # the earlier turns are in the prompt
    assert "… 写一条好评：" in (tmp_path / "multi" / "samples.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_grpo_end_to_end_and_exact_resume(tmp_path, tiny_policy_and_rm, prompts):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert GRPO.main(grpo_args(tiny_policy_and_rm, straight, prompts)) == 0
    config = json.loads((straight / "config.json").read_text(encoding="utf-8"))
    assert config["stage"] == "grpo" and config["model_type"] == "gpt" and config["group_size"] == 4
    held = config["metrics"]["held_out"]
    assert set(held) == {"sft", "grpo"} and {"rm_score", "judge", "kl", "distinct_2", "eos_share"} <= set(held["sft"])
    assert held["sft"]["kl"] == pytest.approx(0.0, abs=1e-6)  # the SFT policy is its own reference
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows[1]["kl"] == pytest.approx(0.0, abs=1e-5)  # the first rollout comes before any update
    assert (straight / "curves.png").is_file() and (straight / "samples.md").is_file()
    assert GRPO.main(grpo_args(tiny_policy_and_rm, halves, prompts, "--stop_after", "2")) == 0
    assert GRPO.main(grpo_args(tiny_policy_and_rm, halves, prompts, "--resume")) == 0
    assert (straight / "model.safetensors").read_bytes() == (halves / "model.safetensors").read_bytes()
