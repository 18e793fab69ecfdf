"""Stage 3: the PPO maths against hand calculations, the rollout's invariants, and the script end to end."""

import copy
import json
import types

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_script, run_script
from gpt_fast import speed_up
from gpt_model import GPTModel, RewardModel, get_preset
from plumbing import alignment, rollouts
from plumbing.flops import FlopCounter

ppo = load_script("3-PPO.py")


def test_gae_matches_a_hand_computed_example():
    """gamma = 1, lambda = 0.95. Row 0 has three real tokens, row 1 two (the third is padding).

    Row 0: deltas 0+0.6-0.5 = 0.1, 0+0.7-0.6 = 0.1, 1-0.7 = 0.3 -> A2 = 0.3, A1 = 0.1+0.95*0.3 = 0.385,
    A0 = 0.1+0.95*0.385 = 0.46575. Row 1: A1 = 2-0.2 = 1.8, A0 = (0.2-0.1)+0.95*1.8 = 1.81; the pad's value 9 is
    ignored."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    expected = torch.tensor([[0.46575, 0.385, 0.3], [1.81, 1.8, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, (expected + torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, 0.0]])) * mask, atol=1e-6)


def test_gae_with_discount():
    """gamma = 0.5, lambda = 1: A_t is the discounted return minus V_t (Monte Carlo)."""
    rewards, values = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.25, 0.5]])
    advantages, _ = ppo.gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[1.0 + 0.5 * 2.0 - 0.25, 2.0 - 0.5]]))


def test_whitening_ignores_padding():
    """Mean 0 and variance 1 over the real positions only; pad positions come back 0 whatever they held."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = ppo.masked_whiten(x, mask)
    real = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (real - real.mean()) / real.var(unbiased=False).sqrt()
    assert torch.allclose(out[mask.bool()], expected, atol=1e-5)
    assert torch.equal(out[~mask.bool()], torch.zeros(2))
    x2 = x.clone()
    x2[1, 1:] = torch.tensor([-7.0, 3e4])
    assert torch.equal(ppo.masked_whiten(x2, mask), out)


def test_reward_sits_on_the_last_real_response_token():
    """Score on the last real token; -beta * (logp - logp_ref) on every real token; nothing on padding."""
    scores = torch.tensor([5.0, -1.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = ppo.kl_penalised_rewards(scores, logp, ref, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.1 * 0.5, 5.0, 0.0], [0.0, 0.0, -1.0]])
    assert torch.allclose(rewards, expected)


def test_response_mask_stops_after_the_first_eos():
    responses = torch.tensor([[7, 102, 102, 102], [7, 8, 9, 10], [102, 102, 102, 102]])
    assert rollouts.response_mask_after(responses, 102).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_ppo_losses_by_hand():
    """Ratio e^0.5 = 1.6487 > 1.2 with A = +1: the clipped term wins (-1.2), clip fraction 1/2; value loss clipped."""
    logp = torch.tensor([[0.5, 0.0]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -2.0]])
    values, old_values, returns = torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[2.0, 0.0]])
    policy_loss, value_loss, clip_fraction, approx_kl = ppo.ppo_losses(
        logp, old, adv, values, old_values, returns, torch.ones(1, 2), cliprange=0.2, cliprange_value=0.2)
    assert policy_loss.item() == pytest.approx((-1.2 + 2.0) / 2)
    assert clip_fraction.item() == pytest.approx(0.5)
    # position 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> max 3.24; position 1: 0
    assert value_loss.item() == pytest.approx(0.5 * 3.24 / 2)
    assert approx_kl.item() == pytest.approx(0.5 * 0.25 / 2)


def test_kl_per_response_sums_the_log_ratio_over_real_tokens():
    """Row 0: (-1 + 1.5) + (-2 + 2) = 0.5, its padded third token ignored; row 1: 1 + 0 - 0.5 = 0.5."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -9.0], [-2.0, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(rollouts.kl_per_response(logp, ref, mask), torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("kl, expected", [
    (6.0, 0.1 * (1 + 0.2 * 16 / 64)),  # error 6/3 - 1 = 1, clipped to 0.2: beta x 1.05
    (2.7, 0.1 * (1 - 0.1 * 16 / 64)),  # error -0.1: beta x 0.975
    (3.0, 0.1),  # on target: unchanged
    (0.0, 0.1 * (1 - 0.2 * 16 / 64)),  # error -1, clipped to -0.2: beta x 0.95
])
def test_kl_controller_update_by_hand(kl, expected):
    assert ppo.adaptive_kl_coef(0.1, kl, target=3.0, samples=16, horizon=64) == pytest.approx(expected)


def test_kl_controller_with_ziegler_horizon_barely_moves():
    """The old setting (horizon 10000, 16 samples an iteration): 20 iterations at twice the target raise beta by
    only 0.6%; the demo's horizon of 64 raises it by 2.6x."""
    slow = fast = 0.05
    for _ in range(20):
        slow = ppo.adaptive_kl_coef(slow, 6.0, 3.0, 16, 10000)
        fast = ppo.adaptive_kl_coef(fast, 6.0, 3.0, 16, 64)
    assert slow / 0.05 == pytest.approx(1.00032 ** 20) and fast / 0.05 == pytest.approx(1.05 ** 20)


def test_unfinished_responses_lose_the_penalty():
    scores, ended = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([True, False, False])
    assert rollouts.penalise_unfinished(scores, ended, 0.5).tolist() == [1.0, 1.5, -1.5]


def test_response_token_lists_drop_prompt_sep_and_padding():
    """Prompt of P = 2; row 0 ends with [SEP] (102) then padding, row 1 runs to the limit."""
    data = {"input_ids": torch.tensor([[0, 9, 5, 6, 102, 102], [9, 9, 7, 7, 7, 7]]), "prompt_len": 2,
            "response_mask": rollouts.response_mask_after(torch.tensor([[5, 6, 102, 102], [7, 7, 7, 7]]), 102).float()}
    assert rollouts.response_token_lists(data) == [[5, 6], [7, 7, 7, 7]]


def test_val_row_keys_round_trip():
    """Monitors -> val_* keys of a metrics row -> monitors; the row's other keys (DPO's own val_ figures, a
    rollout's score) are no monitors."""
    from plumbing.held_out import as_val_row, from_val_row

    monitors = {"rm_score": 1.0, "rm_score_se": 0.1, "judge": 0.6, "judge_se": 0.01, "kl": 2.0, "distinct_2": 0.9,
                "all_pass1": 0.5}
    row = as_val_row(monitors)
    assert row["val_score"] == 1.0 and row["val_score_se"] == 0.1 and row["val_judge"] == 0.6
    assert from_val_row({**row, "val_loss": 0.7, "val_accuracy": 0.5, "step": 0, "score": 5.0}) == monitors


def test_entropy_of_a_uniform_distribution_is_log_v():
    uniform = rollouts.entropy_from_logits(torch.zeros(1, 1, 8)).item()
    assert uniform == pytest.approx(torch.log(torch.tensor(8.0)).item())


def tiny_models(seed=0):
    torch.manual_seed(seed)
    cfg = get_preset("tiny").replace(tie_embeddings=False)
    policy = GPTModel(cfg).eval()
    reward = RewardModel(cfg).eval()
    return policy, copy.deepcopy(policy), reward


def test_response_logprobs_in_groups_cut_to_length_equal_the_full_width_pass(monkeypatch):
    """Five responses of 6, 1, 3, 2 and 4 real tokens measured two rows at a time (sorted by length, each pair cut
    after its longer response) give the log-probs and entropies of one full-width pass at every real position,
    and 0 after each end."""
    policy = tiny_models()[0]
    monkeypatch.setattr(rollouts, "MEASURE_ROWS", 2)
    torch.manual_seed(5)
    sequences = torch.randint(200, 1000, (5, 3 + 6))  # (B, P + R), P = 3
    attention_mask = torch.ones_like(sequences)
    attention_mask[1, :2] = 0  # two left-padded prompts
    attention_mask[3, :1] = 0
    response_mask = (torch.arange(6)[None] < torch.tensor([6, 1, 3, 2, 4])[:, None]).float()  # (5, 6)
    attention_mask[:, 3:] = response_mask.long()
    logprobs, entropy = rollouts.response_logprobs(policy, sequences, attention_mask, response_mask, 3, entropy=True)
    with torch.no_grad():
        logits = rollouts.response_logits(policy, sequences, attention_mask, 3)  # (5, 6, V)
    real = response_mask.bool()
    full_logprobs = rollouts.token_logprobs(logits, sequences[:, 3:])
    assert torch.allclose(logprobs[real], full_logprobs[real], atol=1e-5)
    assert torch.allclose(entropy[real], rollouts.entropy_from_logits(logits)[real], atol=1e-5)
    assert not logprobs[~real].any() and not entropy[~real].any()
    assert logprobs[real].lt(0).all()  # every real position was computed, none left at its initial 0


def test_response_logprobs_reading_each_prompt_once_equal_the_full_width_pass(monkeypatch):
    """Two prompts (one left-padded) answered three times each, rows b*3 .. b*3+2: measured with ``samples=3`` (each
    prompt read once, its cached keys and values copied to its rows, the rows sorted by length and taken two at a
    time) the log-probs and entropies equal those of one full-width pass at every real position, and are 0 after
    each end; the FLOPs are counted as a scoring pass ("forward"), not as sampling."""
    policy = tiny_models()[0]
    monkeypatch.setattr(rollouts, "MEASURE_ROWS", 2)
    torch.manual_seed(6)
    P, R = 4, 5
    prompts = torch.randint(200, 1000, (2, P)).repeat_interleave(3, 0)  # (6, P)
    sequences = torch.cat([prompts, torch.randint(200, 1000, (6, R))], dim=1)  # (6, P + R)
    response_mask = (torch.arange(R)[None] < torch.tensor([5, 1, 3, 2, 4, 1])[:, None]).float()  # (6, R)
    attention_mask = torch.cat([torch.ones(6, P, dtype=torch.long), response_mask.long()], dim=1)
    attention_mask[3:, :2] = 0  # the second prompt is two tokens shorter
    counter = FlopCounter(policy)
    logprobs, entropy = rollouts.response_logprobs(policy, sequences, attention_mask, response_mask, P,
                                                   entropy=True, samples=3)
    assert set(counter.flops) == {"forward"}
    with torch.no_grad():
        logits = rollouts.response_logits(policy, sequences, attention_mask, P)  # (6, R, V)
    real = response_mask.bool()
    assert torch.allclose(logprobs[real], rollouts.token_logprobs(logits, sequences[:, P:])[real], atol=1e-5)
    assert torch.allclose(entropy[real], rollouts.entropy_from_logits(logits)[real], atol=1e-5)
    assert not logprobs[~real].any() and not entropy[~real].any()
    assert logprobs[real].lt(0).all()
    with pytest.raises(ValueError, match="must share a prompt"):  # rows of one group with different prompts
        rollouts.response_logprobs(policy, sequences.roll(1, dims=0), attention_mask, response_mask, P, samples=3)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        rollouts.response_logprobs(policy, sequences, attention_mask, response_mask, P, samples=0)


@pytest.mark.parametrize("fast", [False, True])
def test_response_logits_reading_each_prompt_once_give_the_full_pass_values_and_gradients(fast):
    """An update's minibatch as GRPO draws it: five rows answering three prompts (one left-padded) in shuffled order.
    With ``prompt_of`` each prompt is read once, with gradient, and the answers attend to its cached keys and values:
    the logits at the real positions and every parameter's gradient of a loss on them equal those of the full pass
    (the lesson's model and the fast one). In float64, so that the two orders of summation agree to 1e-10 and any
    missing or extra term shows (in float32 they differ by up to 1e-5 of a gradient's largest entry). The passes
    count as training; rows whose prompts differ are refused."""
    policy = tiny_models()[0].double()
    if fast:
        speed_up(policy)
    torch.manual_seed(7)
    P, R = 4, 3
    prompts = torch.randint(200, 1000, (3, P))  # (3, P)
    prompt_of = torch.tensor([2, 0, 2, 1, 0])  # (5,)
    sequences = torch.cat([prompts[prompt_of], torch.randint(200, 1000, (5, R))], dim=1)  # (5, P + R)
    response_mask = (torch.arange(R)[None] < torch.tensor([3, 1, 2, 3, 2])[:, None]).float()  # (5, R)
    attention_mask = torch.cat([torch.ones(5, P, dtype=torch.long), response_mask.long()], dim=1)
    attention_mask[prompt_of == 1, :2] = 0  # prompt 1 is two tokens shorter
    weights = torch.randn(5, R, dtype=torch.float64)
    real = response_mask.bool()
    results = []
    for shared in (None, prompt_of):
        policy.zero_grad()
        counter = FlopCounter(policy)
        logits = rollouts.response_logits(policy, sequences, attention_mask, P, prompt_of=shared)  # (5, R, V)
        logp = rollouts.token_logprobs(logits, sequences[:, P:])
        (torch.where(real, logp, 0.0) * weights).sum().backward()
        results.append((logp.detach()[real], {n: p.grad.clone() for n, p in policy.named_parameters()}))
        assert set(counter.flops) == {"train"}
    (full, full_grads), (once, once_grads) = results
    assert torch.allclose(once, full, atol=1e-10, rtol=0)
    for name, grad in full_grads.items():
        assert torch.allclose(once_grads[name], grad, atol=1e-10, rtol=0), name
    assert full_grads["trf_blocks.0.att.W_key.weight"].abs().sum() > 0  # the prompts' keys get their gradient
    with pytest.raises(ValueError, match="must share their prompt"):
        rollouts.response_logits(policy, sequences, attention_mask, P, prompt_of=torch.tensor([2, 0, 1, 1, 0]))
    with pytest.raises(ValueError, match="one prompt index per row"):
        rollouts.response_logits(policy, sequences, attention_mask, P, prompt_of=prompt_of[:4])


def test_reading_each_prompt_once_gives_the_same_gradient_bit_for_bit_every_time():
    """Thirty-two answers to four prompts, forward and backward ten times: the gradients are the same to the last bit
    each time (``PromptCache.rows`` and the first logits are taken with ``index_select``, whose backward adds in a
    fixed order; indexing's backward adds with atomic adds from several threads, in an order that varies, and made
    a resumed GRPO run differ from one run straight through)."""
    policy = tiny_models()[0]
    torch.manual_seed(8)
    P, R = 12, 6
    prompt_of = torch.randperm(32) % 4  # (32,)
    sequences = torch.cat([torch.randint(200, 1000, (4, P))[prompt_of], torch.randint(200, 1000, (32, R))], dim=1)
    attention_mask = torch.ones_like(sequences)
    grads = []
    for _ in range(10):
        policy.zero_grad()
        logits = rollouts.response_logits(policy, sequences, attention_mask, P, prompt_of=prompt_of)  # (32, R, V)
        rollouts.token_logprobs(logits, sequences[:, P:]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


def test_kl_is_zero_and_ratio_is_one_before_the_first_update(tokenizer):
    """Dropout off: the reference equals the policy, so the rollout's KL is exactly 0, and recomputing the
    log-probs through the training module gives a ratio of exactly 1."""
    policy, ref, reward = tiny_models()
    critic = copy.deepcopy(reward)
    args = types.SimpleNamespace(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(3)
    prompts = ["写一条好评：", "你好", "解释词语：明月"]
    data = rollouts.rollout(policy, prompts, ref=ref, tokenizer=tokenizer, args=args, context_length=64,
                            device="cpu", critic=critic)
    assert torch.equal(data["logprobs"], data["ref_logprobs"])
    assert torch.equal(rollouts.kl_per_response(data["logprobs"], data["ref_logprobs"], data["response_mask"]),
                       torch.zeros(3))
    assert data["ended"].tolist() == [bool((r == 102).any()) for r in data["input_ids"][:, data["prompt_len"]:]]
    P = data["prompt_len"]
    with torch.no_grad():
        out = ppo.PolicyAndCritic(policy, critic).eval()(data["input_ids"], data["attention_mask"])
    new_logp = rollouts.token_logprobs(out["logits"][:, P - 1:-1], data["input_ids"][:, P:])
    assert torch.equal(torch.exp(new_logp - data["logprobs"]), torch.ones_like(new_logp))
    assert torch.equal(out["values"][:, P - 1:-1], data["values"])


def test_the_rm_reward_scores_each_response_like_the_reward_model_alone(tokenizer):
    """The batched, left-padded rollout, scored by the RM as a reward, gives each row exactly the score the RM gives
    that sequence on its own."""
    policy, ref, reward = tiny_models(1)
    args = types.SimpleNamespace(max_new_tokens=5, temperature=1.0)
    prompts = ["短", "一个长一点的提示"]
    data = rollouts.rollout(policy, prompts, ref=ref, tokenizer=tokenizer, args=args, context_length=64,
                            device="cpu", critic=reward)
    scores = alignment.rm_reward(reward)(data["prompts"], data)
    for row in range(2):
        real = data["attention_mask"][row].bool()
        alone = reward(data["input_ids"][row][real][None])["rewards"]
        assert scores[row].item() == pytest.approx(alone.item(), abs=1e-5)


def test_k_samples_of_a_prompt_are_the_draws_of_the_prompt_written_k_times(tokenizer):
    """``rollout(..., samples=k)`` reads each prompt once and answers it k times (rows b*k .. b*k+k-1): the same
    tokens and prompts per row as the prompts written out k times each, from the same seed, and the same log-probs
    up to rounding (the measurement reads each prompt once too)."""
    policy, ref, _ = tiny_models(2)
    args = types.SimpleNamespace(max_new_tokens=6, temperature=1.0)
    prompts = ["写一条好评：", "你好"]
    runs = []
    for rows, k in ((prompts, 3), (rollouts.each(prompts, 3), 1)):
        torch.manual_seed(5)
        runs.append(rollouts.rollout(policy, rows, ref=ref, tokenizer=tokenizer, args=args, context_length=64,
                                     device="cpu", samples=k))
    shared, written = runs
    assert shared["prompts"] == written["prompts"] == ["写一条好评："] * 3 + ["你好"] * 3
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(shared[key], written[key]), key
    for key in ("logprobs", "ref_logprobs"):  # each prompt read once by the measurement too: equal up to rounding
        assert torch.allclose(shared[key], written[key], atol=1e-5), key


@pytest.fixture(scope="module")
def ppo_parents(tmp_path_factory, tiny_policy_and_rm):
    """A tiny policy (the pretrain checkpoint stands in for SFT), a tiny reward model built on it, and 12 prompts."""
    policy, rm_dir = tiny_policy_and_rm
    prompts = tmp_path_factory.mktemp("prompts")
    (prompts / "p.jsonl").write_text("".join(json.dumps({"prompt": f"写一条好评：第{i}条"}, ensure_ascii=False) + "\n"
                                             for i in range(12)), encoding="utf-8")
    return policy, rm_dir, prompts / "p.jsonl"


def run_ppo(out, parents, *extra):
    policy, rm, prompts = parents
    return run_script("3-PPO.py", "--preset", "tiny", "--policy", policy, "--reward", rm, "--prompts_file", prompts,
                      "--val_prompts_file", prompts, "--output_dir", out, *extra)


@pytest.mark.slow
def test_ppo_script_runs_and_resumes_exactly(tmp_path, ppo_parents):
    """4 iterations straight == 2, stop, --resume 2 more (rollout sampling, critic, optimizer and beta restored);
    the checkpoint is a GPT policy that records its parents and the held-out score gain."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run_ppo(straight, ppo_parents)
    assert result.returncode == 0, result.stderr[-2000:]
    assert run_ppo(resumed, ppo_parents, "--stop_after", "2").returncode == 0
    assert (resumed / "state" / "critic.safetensors").exists()
    result = run_ppo(resumed, ppo_parents, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((straight / "config.json").read_text(encoding="utf-8"))
    assert config["stage"] == "ppo" and config["model_type"] == "gpt"
    assert set(config["metrics"]) >= {"kl", "held_out", "held_out_settings", "reward_hacking"}
    held_out = config["metrics"]["held_out"]
    assert set(held_out["sft"]) == set(held_out["ppo"]) >= {"rm_score", "judge", "judge_se", "kl", "entropy",
                                                            "length", "eos_share", "distinct_2", "longest_run"}
    assert held_out["sft"]["kl"] == 0.0  # the SFT policy is its own reference
    rows = [json.loads(r) for r in (straight / "metrics.jsonl").read_text().splitlines()]
    baseline = held_out["sft"]["rm_score"]
    assert rows[0]["step"] == 0 and rows[0]["val_score"] == pytest.approx(baseline, abs=1e-5)  # the curve's start
    assert rows[1]["kl"] == 0.0  # the first rollout comes from the untouched policy
    assert {"score", "judge", "kl", "kl_coef", "clip_fraction", "entropy", "value_loss", "length", "eos_share",
            "distinct_2", "longest_run", "val_judge", "val_kl"} <= set(rows[-1])
    assert {"val_judge", "val_distinct_2", "val_eos_share"} <= set(rows[0])
    assert (straight / "curves.png").exists() and (straight / "samples.md").exists()


@pytest.mark.slow
def test_flag_fires_on_a_deliberately_hacked_run(tmp_path, ppo_parents):
    """No KL penalty and no controller, no ratio clip, no early stop, a learning rate 100x the tiny preset's: the
    policy runs away from SFT and config.json says so in one sentence beside the held-out monitors of both.

    What a tiny run can show: its "SFT" policy is nearly uniform (entropy ~9.9 nats, about log V), so in 6
    iterations the KL shoots past the budget (~40 nats per response) while repetition does not collapse and the
    judge's fall on 16 samples stays within its noise; those rules are tested on constructed monitors in
    test_judge.py."""
    out = tmp_path / "hacked"
    result = run_ppo(out, ppo_parents, "--kl_coef", "0", "--target_kl", "0", "--cliprange", "100",
                     "--max_approx_kl", "0", "--learning_rate", "1e-2", "--ppo_epochs", "8", "--max_steps", "6",
                     "--eval_every", "6")
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((out / "config.json").read_text(encoding="utf-8"))["metrics"]
    flag = metrics["reward_hacking"]
    assert flag.startswith("reward hacking suspected: ") and "past the limit of 3" in flag, flag
    assert flag in result.stdout
    sft, hacked = metrics["held_out"]["sft"], metrics["held_out"]["ppo"]
    assert sft["kl"] == 0.0 and hacked["kl"] > 3.0 and metrics["kl"] == pytest.approx(hacked["kl"], abs=1e-4)
    assert hacked["entropy"] < sft["entropy"]


@pytest.mark.slow
def test_missing_reward_model_is_a_one_line_error(tmp_path, ppo_parents):
    policy, _, prompts = ppo_parents
    result = run_script("3-PPO.py", "--preset", "tiny", "--policy", policy, "--reward", tmp_path / "no-rm",
                        "--prompts_file", prompts, "--val_prompts_file", prompts, "--output_dir", tmp_path / "out")
    assert result.returncode == 2 and "no-rm" in result.stderr
    assert "--reward" in result.stderr and "2-RM.py" in result.stderr  # names the flag and what writes one
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_pretrained_policy_is_named_in_a_note(tmp_path, tiny_policy_and_rm, tokenizer, capsys):
    """A pretrain checkpoint as --policy (the usual slip for checkpoints/sft) loads, with a note on stderr that it
    never learned the chat template; an SFT checkpoint loads without one."""
    import shutil

    policy, rm = tiny_policy_and_rm
    args = types.SimpleNamespace(policy=str(policy), reward=str(rm), max_new_tokens=8)
    alignment.load_policy_and_reward(args, tokenizer, "cpu")
    err = capsys.readouterr().err
    assert err.startswith(f"note: --policy {policy} is a pretrain checkpoint") and "1-SFT.py" in err
    sft = tmp_path / "sft"
    shutil.copytree(policy, sft)
    config = json.loads((sft / "config.json").read_text(encoding="utf-8"))
    (sft / "config.json").write_text(json.dumps({**config, "stage": "sft"}), encoding="utf-8")
    args.policy = str(sft)
    alignment.load_policy_and_reward(args, tokenizer, "cpu")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("script", ["3-PPO.py", "3-GRPO.py", "3-DPO.py"])
def test_no_sampling_temperature_to_get_wrong(tmp_path, script):
    """--temperature 0.7 used to sample at 0.7 while PPO scored log-probs (and KL) at 1.0, training one distribution
    on the samples of another; the alignment stages now sample the policy itself and refuse the flag."""
    result = run_script(script, "--preset", "tiny", "--temperature", "0.7", "--output_dir", tmp_path / "out")
    assert result.returncode == 2 and "unrecognized arguments: --temperature 0.7" in result.stderr
    assert not (tmp_path / "out").exists()


def test_held_out_monitors_measure_the_same_models_once(tokenizer, monkeypatch):
    """The pipeline runs PPO, DPO and GRPO in one process, and each measures the SFT policy first: a second call
    with the same weights, prompts and settings returns the first call's rows without sampling again; changed
    weights, another seed or autocast are measured anew."""
    from plumbing import held_out as held_out_module

    policy, ref, reward = tiny_models()
    def judge(texts):  # a stand-in judge: the cache is what is tested
        return [0.5] * len(texts)

    monkeypatch.setattr(held_out_module, "_MEASURED", {})
    calls = []
    answer = held_out_module._answer
    monkeypatch.setattr(held_out_module, "_answer", lambda *a: calls.append(a) or answer(*a))
    prompts = ["写一条好评：", "你好"]

    def measure(seed=7):
        args = types.SimpleNamespace(max_new_tokens=4, seed=seed)
        return held_out_module.measure(policy, ref, prompts, 2, tokenizer, args, 64, "cpu", reward_model=reward,
                                       judge=judge)

    first = measure()
    first[0]["rm_score"] = None  # the caller's copy: changing it must not change what the next caller gets
    again = measure()
    assert len(calls) == 1 and again[0]["rm_score"] is not None
    assert [r["rm_score"] for r in again] == [r["rm_score"] for r in measure()]
    measure(seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measure()
    with torch.no_grad():
        next(policy.parameters()).add_(0.01)
    measure()
    assert len(calls) == 4


def test_a_held_out_row_per_answer_by_hand(tokenizer):
    """``held_out.measure``: one row per sampled answer, k per prompt in order; the RM score of the first
    READ_SAMPLES answers of each prompt, equal to the RM on that sequence alone, and their KL and entropy (KL exactly 0
    for the reference's own weights), none on the later answers; and the preference summary's figures are the means
    of those rows."""
    from plumbing import held_out as held_out_module

    policy, ref, reward = tiny_models(4)
    prompts = ["写一条好评：", "你好", "解释词语：明月"]
    args = types.SimpleNamespace(max_new_tokens=5, seed=3)
    rows = held_out_module.measure(policy, ref, prompts, 5, tokenizer, args, 64, "cpu", reward_model=reward,
                                   judge=lambda texts: [0.25] * len(texts))
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, j) for p in range(3) for j in range(5)]
    read = [j < held_out_module.READ_SAMPLES for p in range(3) for j in range(5)]
    assert [("rm_score" in r) for r in rows] == [("kl" in r) for r in rows] == read
    assert [r["kl"] for r in rows if "kl" in r] == [0.0] * sum(read)  # ref is a copy of the policy: the same weights
    for r in rows[:2]:
        ids = rm_tokens(tokenizer, prompts[r["prompt"]], r["ids"], r["ended"])
        alone = reward(torch.tensor([ids]))["rewards"].item()
        assert r["rm_score"] == pytest.approx(alone, abs=1e-5)
    monitors = held_out_module.answer_monitors(rows)
    rated = [r["rm_score"] for r in rows if "rm_score" in r]
    assert monitors["rm_score"] == pytest.approx(sum(rated) / len(rated)) and monitors["judge"] == 0.25
    assert monitors["length"] == pytest.approx(sum(len(r["ids"]) for r in rows) / len(rows))
    assert monitors["kl"] == 0.0


def rm_tokens(tokenizer, prompt, response_ids, ended):
    """The tokens the RM reads for one answer: [CLS] prompt [ANS] response, and [SEP] when it ended."""
    from chinese_tokenizer import EOS_ID, chat_prompt_ids

    return chat_prompt_ids(prompt, tokenizer, 64) + response_ids + ([EOS_ID] if ended else [])


@pytest.mark.parametrize("script, argv, says", [
    ("3-PPO.py", ["--gamma", "2"], "--gamma: must be in [0, 1], got 2"),
    ("3-PPO.py", ["--lam", "-0.5"], "--lam: must be in [0, 1], got -0.5"),
])
def test_out_of_range_rl_settings_are_refused(tmp_path, script, argv, says):
    result = run_script(script, "--preset", "tiny", *argv, "--output_dir", tmp_path / "out")
    assert result.returncode == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
