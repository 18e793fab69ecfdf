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
    adv = GRPO.group_advantages(scores, 2)[0]
    # group (1, 3): mean 2, unbiased std sqrt(2); group (2, 2) and (5, 5): no spread, no advantage
    assert adv.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0, 0, 0, 0], abs=1e-5)
    adv4 = GRPO.group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), 4)[0]  # mean 1.5, std sqrt(5/3)
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
    per_seq = [(-2.0 * 2 + 0.5 * (k3[0, 0] + k3[0, 1])) / 2, (1.0 * 3 + 0.5 * k3[1].sum()) / 3]  # -A |o| + beta sum k3
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


def test_equal_rewards_give_exactly_zero_advantages_and_are_counted():
    """Eight fp32 scores of 0.35 (or 0.7) differ only by rounding: their advantages are exactly 0, not rounding noise
    over a tiny spread (|A| was 0.029 and 0.056), and the group counts as flat; a group with a real spread does not."""
    for value in (0.35, 0.7):
        scores = torch.cat([torch.full((8,), value, dtype=torch.float32), torch.arange(8, dtype=torch.float32)])
        adv, flat = GRPO.group_advantages(scores, 8)
        assert adv[:8].tolist() == [0.0] * 8 and flat.tolist() == [True, False]
        assert adv[8:].tolist() == pytest.approx([(v - 3.5) / math.sqrt(6.0) for v in range(8)], abs=1e-6)
    verifier = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # right, wrong, mixed
    assert GRPO.group_advantages(verifier, 4)[1].tolist() == [True, True, False]


def test_term_advantages_by_hand_scale_by_the_batch_not_the_group():
    """Three groups of two: two ask for a 好评 (scored), one does not (NaN). Each scored answer's RM score minus its
    group's mean, over the unbiased spread of those differences across the scored rows: the group whose answers
    differ by 0.1 gets small advantages (its own spread would make them +-0.71, as large as the verifier's); the
    unscored group gets none."""
    nan = float("nan")
    scores = torch.tensor([1.0, 3.0, 0.1, 0.2, nan, nan])
    spread = math.sqrt((1 + 1 + 0.05 ** 2 + 0.05 ** 2) / 3)
    adv = GRPO.term_advantages(scores, 2)
    assert adv.tolist() == pytest.approx([-1 / spread, 1 / spread, -0.05 / spread, 0.05 / spread, 0, 0], abs=1e-6)
    assert abs(adv[3].item()) < 0.1 < GRPO.group_advantages(scores[:4], 2)[0][3].item()
    # nothing to rank: one scored row, or scored rows all alike within their groups
    assert GRPO.term_advantages(torch.tensor([1.0] + [nan] * 5), 1).tolist() == [0.0] * 6
    assert GRPO.term_advantages(torch.tensor([2.0, 2.0, 7.0, 7.0]), 2).tolist() == [0.0] * 4


def test_grpo_advantages_add_each_further_reward_at_its_weight():
    """The first reward (less the penalty of an answer that never ended) relative to its group, plus the second's
    term_advantages times its weight: two groups of two, by hand."""
    import types

    nan = float("nan")
    rewards = torch.tensor([[1.0, 1.0], [0.0, 3.0], [1.0, nan], [1.0, nan]])  # (B, K): verifier, RM on reviews
    ended = torch.tensor([True, True, True, False])
    args = types.SimpleNamespace(no_eos_penalty=1.0, group_size=2)
    adv, flat = GRPO.grpo_advantages(rewards, torch.tensor([1.0, 0.5]), ended, args)
    # group 1: verifier 1, 0: (x - 0.5) / 0.7071 = +-0.7071; RM 1, 3, the only scored group: its differences -1, +1
    # over their spread sqrt(2) = -+0.7071, times 0.5. Group 2: verifier 1 and 1 - 1 (never ended) = 0: +-0.7071
    s = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([s - 0.5 * s, -s + 0.5 * s, s, -s], abs=1e-6)
    assert flat.tolist() == [False, False]


def test_the_review_reward_counts_the_rm_for_a_praise_and_against_it_for_a_complaint():
    """The RM scores how positive a review is: on a 好评 problem its score is the answer's quality, on a 差评 its
    negative; another family's answer is no review (NaN: the reward does not apply). A stand-in RM returns each
    row's first id."""
    from plumbing.alignment import review_reward

    def stand_in_rm(input_ids, attention_mask):
        return {"rewards": input_ids[:, 0].float()}

    prompts = [{"prompt": "写一条不超过二十个字的好评。", "answer": "max_chars:20", "family": "instruction"},
               {"prompt": "写一条差评，十个字以内。", "answer": "max_chars:10", "family": "instruction"},
               {"prompt": "这条评论是正面的还是负面的？“好”", "answer": "正面", "family": "sentiment"}]
    responses = {"input_ids": torch.tensor([[3, 1], [5, 1], [7, 1]]), "attention_mask": torch.ones(3, 2)}
    scores = review_reward(stand_in_rm)(prompts, responses)
    assert scores[:2].tolist() == [3.0, -5.0] and math.isnan(scores[2].item())


def test_rm_weight_needs_a_verifier_and_a_reward_model(tmp_path, tiny_policy_and_rm, capsys):
    """--rm_weight without --verifier, and with 好评 problems but no RM checkpoint in --reward: one-line errors that
    name the flag and the fix, exit 2, nothing written."""
    from plumbing.cli import run

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "写一条不超过二十个字的好评。", "answer": "max_chars:20",
                                 "family": "instruction"}, ensure_ascii=False) + "\n", encoding="utf-8")
    policy, _ = tiny_policy_and_rm
    common = ["--preset", "tiny", "--policy", str(policy), "--output_dir", str(tmp_path / "out")]
    for extra, message in (([], "without --verifier the reward is the reward model's alone"),
                           (["--verifier", "exact", "--prompts_file", str(tasks), "--val_prompts_file", str(tasks),
                             "--reward", str(tmp_path / "no_rm")], "give --rm_weight 0 for the verifier alone")):
        with pytest.raises(SystemExit) as exit_:
            run(GRPO.main, [*common, *extra, "--rm_weight", "0.1"])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err.startswith("error: --rm_weight 0.1 ") and message in err
        assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_rm_weight_adds_the_reward_models_term_on_praise_problems(tmp_path, tiny_policy_and_rm):
    """GRPO with --verifier on 好评 and 差评 instructions that a tiny model never keeps (every group flat for the
    verifier): with --rm_weight 0 nothing moves the policy but the KL term; with 0.1 the RM's term trains it, the RM's
    mean score of each side is logged, and the checkpoint records the RM it was rewarded by and its weight."""
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"prompt": f"写一条不超过{words}个字的{kind}。", "answer": f"max_chars:{n}", "family": "instruction"}
            for n, words in ((10, "十"), (20, "二十")) for kind in ("好评", "差评")]
    tasks.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    policy, rm = tiny_policy_and_rm
    runs = {}
    for weight in ("0", "0.1"):
        out = tmp_path / weight
        assert GRPO.main(["--preset", "tiny", "--verifier", "exact", "--policy", str(policy), "--reward", str(rm),
                          "--prompts_file", str(tasks), "--val_prompts_file", str(tasks), "--output_dir", str(out),
                          "--max_steps", "2", "--eval_examples", "4", "--rm_weight", weight]) == 0
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        runs[weight] = ((out / "model.safetensors").read_bytes(), [r for r in logged if "flat_groups" in r], config)
    (unweighted, rows0, config0), (weighted, rows1, config1) = runs["0"], runs["0.1"]
    assert all(r["flat_groups"] == 1.0 for r in rows0 + rows1)  # the verifier teaches nothing here
    assert weighted != unweighted and "reward_sha256" in config1 and "reward_sha256" not in config0
    assert all("rm_score_praise" in r and "rm_score_complaint" in r for r in rows1)
    assert not any("rm_score_praise" in r for r in rows0)
    assert [c["metrics"]["held_out_settings"]["rm_weight"] for c in (config0, config1)] == [0, 0.1]


def test_a_padded_position_far_from_the_reference_leaks_no_nan():
    """A padded position whose log-prob is -120 against the reference's -1 would overflow exp: the loss, its KL and
    every gradient stay finite and equal to those without that position."""
    logp = torch.tensor([[-1.0, -2.0, -120.0]], requires_grad=True)
    old, ref = torch.tensor([[-1.0, -2.0, -1.0]]), torch.tensor([[-1.5, -2.0, -1.0]])
    mask, adv = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1.0])
    loss, clip_fraction, kl = GRPO.grpo_loss(logp, old, ref, adv, mask, 0.2, 0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(kl) and torch.isfinite(logp.grad).all()
    short = logp.detach()[:, :2].clone().requires_grad_(True)
    loss2, _, kl2 = GRPO.grpo_loss(short, old[:, :2], ref[:, :2], adv, mask[:, :2], 0.2, 0.5)
    loss2.backward()
    assert loss.item() == pytest.approx(loss2.item()) and kl.item() == pytest.approx(kl2.item())
    assert logp.grad[0, 2] == 0 and torch.allclose(logp.grad[:, :2], short.grad)
    ppo = load_script("3-PPO.py")
    values = torch.zeros(1, 3)
    losses = ppo.ppo_losses(logp.detach(), old, torch.ones(1, 3), values, values, values, mask, 0.2, 0.2)
    assert all(torch.isfinite(x) for x in losses)


def test_clip_fraction_counts_where_the_clip_bounds_the_objective_as_ppo_does():
    """Four tokens with ratios e^0.5, e^0.5, e^-0.5, 1 and advantages +1, -1, -1, +1: the clip binds on the first
    (ratio too high, A > 0) and the third (ratio too low, A < 0), 2 of 4, as PPO's ppo_losses counts; the second
    has left [0.8, 1.2] but the objective follows its ratio there."""
    logp = torch.tensor([[0.5, 0.5, -0.5, 0.0]])
    old = torch.zeros(1, 4)
    ppo = load_script("3-PPO.py")
    zeros, adv_tokens = torch.zeros(1, 4), torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    _, _, ppo_fraction, _ = ppo.ppo_losses(logp, old, adv_tokens, zeros, zeros, zeros, torch.ones(1, 4), 0.2, 0.2)
    per_token = []  # GRPO has one advantage per response: each token on its own, as a response of one token
    for j in range(4):
        m = torch.zeros(1, 4)
        m[0, j] = 1
        per_token.append(GRPO.grpo_loss(logp, old, old, adv_tokens[0, j:j + 1], m, 0.2, 0.0)[1].item())
    assert ppo_fraction.item() == pytest.approx(0.5) and sum(per_token) == 2 and per_token == [1, 0, 1, 0]


@pytest.mark.slow
def test_a_nan_reward_stops_the_run_before_any_update(tmp_path, tiny_policy_and_rm, prompts, monkeypatch, capsys):
    """One NaN RM score stops GRPO with a one-line error naming the prompt, before backward and the optimizer step
    (which used to spread it to every weight): no checkpoint is written."""
    import plumbing.alignment as alignment
    from plumbing.cli import run

    real = alignment.rm_reward

    def nan_reward(reward_model):
        def reward(prompts, responses):
            scores = real(reward_model)(prompts, responses)
            if len(scores) == 16:  # the training rollouts (4 prompts x 4)
                scores[5] = float("nan")
            return scores
        return reward

    monkeypatch.setattr(alignment, "rm_reward", nan_reward)  # what Online's reward list calls
    stepped = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: stepped.append(1))
    with pytest.raises(SystemExit) as exit_:
        run(GRPO.main, grpo_args(tiny_policy_and_rm, tmp_path / "nan", prompts))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    err = err[err.index("error: "):]  # after the progress bar's \r
    assert exit_.value.code == 2 and err.startswith("error: the rm reward of the answer to prompt")
    assert "nan" in err and not stepped and not (tmp_path / "nan" / "config.json").exists()


def test_a_non_finite_gradient_is_never_applied(tmp_path):
    """StageRun.clip_gradients holds back the optimizer step of a gradient whose norm is inf, and end_step then
    stops the run with a one-line error: the weights are the ones before that step."""
    import types

    from accelerate import Accelerator

    from plumbing.cli import UserError
    from plumbing.training import StageRun

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    args = types.SimpleNamespace(output_dir=str(tmp_path), resume=False, max_steps=2, stop_after=None,
                                 save_every=None, eval_every=2, max_grad_norm=1.0, learning_rate=0.1, warmup_steps=0)
    stage = StageRun("test", args, accelerator, model, optimizer, None, {}, plot=("c.png", []))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError, match=r"^the gradient norm became (inf|nan) at step 1 .* was not applied"):
        for _ in stage.steps():
            with stage.accumulate():
                loss = (model(torch.tensor([[1.0, 2.0]])) * float("inf")).sum()
                accelerator.backward(loss)
            if stage.clip_gradients():
                optimizer.step()
            optimizer.zero_grad()
            stage.end_step(1.0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
