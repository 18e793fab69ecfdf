"""plumbing/flops.py: the FLOPs of a pass and of training against counts made by hand, the counter that adds them up
for every pass a stage runs, and the GPU peak table."""

import pytest
import torch

from gpt_fast import generate, speed_up
from gpt_model import GPTModel, RewardModel, get_preset
from plumbing.flops import (
    FlopCounter,
    bf16_peak,
    counting_as,
    format_speed,
    format_utilisation,
    matmul_flop_s,
    matmul_parameters,
    pass_flops,
    speed_record,
    training_flops_per_token,
    utilisation,
)


def test_flops_of_the_tiny_preset_counted_by_hand():
    """tiny: V 21128, E 32, H 2, L 2, no q/k/v bias, LayerNorm, tied head. Per block: W_query, W_key, W_value
    3·32·32 = 3072, out_proj 32·32 + 32 = 1056, MLP 32·128 + 128 + 128·32 + 32 = 8352, two norms 4·32 = 128: 12608.
    Two blocks 25216, final norm 64, head 21128·32 = 676096: N = 701376. At T = 64: 6N = 4208256 plus attention
    12·L·H·Q·T = 12·2·2·16·64 = 49152."""
    cfg = get_preset("tiny")
    assert matmul_parameters(cfg) == 701376
    assert training_flops_per_token(cfg, 64) == 4208256 + 49152
    assert matmul_parameters(cfg, lm_head=False) == 701376 - 676096 + 33  # a reward model's (E -> 1) head


@pytest.mark.parametrize("preset", ["tiny", "demo", "gpt2-zh-small", "uer-gpt2-chinese"])
def test_n_is_the_models_parameters_less_the_tables_it_only_looks_up(preset):
    """The count from the config agrees with the model's own parameters: all of them, less the position table and,
    when the head has its own weights, the token table (a tied table is the head, counted once)."""
    cfg = get_preset(preset)
    model = GPTModel(cfg)
    looked_up = {"pos_emb.weight"} | ({"tok_emb.weight"} if not cfg.tie_embeddings else set())
    expected = sum(p.numel() for n, p in model.named_parameters() if n not in looked_up)
    assert matmul_parameters(cfg) == expected


def test_attention_term_grows_with_the_sequence():
    cfg = get_preset("gpt2-zh-small")
    assert training_flops_per_token(cfg, 256) - training_flops_per_token(cfg, 128) == 12 * 12 * 12 * 64 * 128
    with pytest.raises(ValueError, match="seq_len"):
        training_flops_per_token(cfg, 0)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA L4", 121e12), ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("NVIDIA L40S", None), ("Tesla T4", None), ("NVIDIA GeForce RTX 3090", None)])
def test_the_peak_table_matches_whole_names(name, peak):
    assert bf16_peak(name) == peak


def test_utilisation_has_a_percentage_only_with_a_peak():
    assert format_utilisation(utilisation(4e14, 989.4e12)) == "400 TFLOP/s (MFU 40.4%)"
    assert format_utilisation(utilisation(2e10, None)) == "20 GFLOP/s"
    assert "mfu" not in utilisation(1.0, None)


def test_a_pass_counted_by_hand():
    """tiny (N = 701376, of which the head 676096 and the body 25280; L 2, E 32): one row, 3 new tokens after 5
    cached ones, the head on the last position alone. Matrices 2·(25280·3 + 676096·1) = 1503872; attention
    4·L·E·T·(past + T) = 4·2·32·3·8 = 6144."""
    cfg = get_preset("tiny")
    assert pass_flops(cfg, 1, 3, past=5, head_tokens=1) == 1503872 + 6144
    assert pass_flops(cfg, 4, 3, past=5, head_tokens=1) == 4 * (1503872 + 6144)
    # training: backward = the input gradients (the matrices again, attention twice) + the weights' (share x matrices)
    assert pass_flops(cfg, 1, 3, past=5, head_tokens=1, trained_share=1.0) == 3 * 1503872 + 3 * 6144
    assert pass_flops(cfg, 1, 3, past=5, head_tokens=1, trained_share=0.0) == 2 * 1503872 + 3 * 6144
    # a reward model: an (E -> 1) head of 33 parameters on every position
    assert pass_flops(cfg, 1, 3, lm_head=False) == 2 * (25280 * 3 + 33 * 3) + 4 * 2 * 32 * 3 * 3
    # padding is not the model's work: a row of 3 real tokens after 2 pads and a full row of 5 are 8 tokens through
    # the matrices and the head, and 3·3 + 5·5 = 34 query-key pairs
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert pass_flops(cfg, 2, 5, attention_mask=mask) == 2 * (25280 * 8 + 676096 * 8) + 4 * 2 * 32 * 34
    # one decoding step of those rows: 1 new token each, against 4 and 6 real keys
    step = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert pass_flops(cfg, 2, 1, 5, head_tokens=1, attention_mask=step) == 2 * (25280 + 676096) * 2 + 4 * 2 * 32 * 10
    with pytest.raises(ValueError, match="tokens"):
        pass_flops(cfg, 1, 0)


def test_the_counter_adds_every_pass_by_kind():
    """Each call of a watched model adds the ``pass_flops`` of its shapes, written here by hand, to its kind."""
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    policy, reward_model = speed_up(GPTModel(cfg)), RewardModel(cfg)
    counter = FlopCounter(policy, reward_model, None, policy)  # watched twice, counted once; None passed over
    ids = torch.randint(5, 100, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100  # 12 of 20 positions go through the head
    policy(ids, labels=labels)["loss"].backward()
    assert counter.flops == {"train": pass_flops(cfg, 2, 10, head_tokens=6, trained_share=1.0)}
    with torch.no_grad():
        policy(ids, logits_to_keep=3)  # the logits of the last 3 positions
        reward_model(ids)
        ended = torch.ones(2, 10, dtype=torch.long)
        ended[0, -2:] = 0  # the first row's answer ended 2 positions before the last: 1 + 3 of the 6 kept are real
        policy(ids, attention_mask=ended, logits_to_keep=3)
    by_hand = (pass_flops(cfg, 2, 10, head_tokens=3) + pass_flops(cfg, 2, 10, lm_head=False)
               + pass_flops(cfg, 2, 10, head_tokens=4 / 2, attention_mask=ended))
    assert counter.flops["forward"] == by_hand
    generate(policy, ids, 4, cfg.context_length, eos_id=None)  # a prefill, then 3 steps against 10, 11, 12 keys
    sampled = pass_flops(cfg, 2, 10, head_tokens=1) + sum(pass_flops(cfg, 2, 1, past) for past in (10, 11, 12))
    assert counter.flops["sample"] == sampled
    with counting_as("held_out"), torch.no_grad():
        policy(ids)
        with counting_as("forward"):  # the outermost kind decides (a scoring pass inside the held-out measurement)
            reward_model(ids, (torch.arange(10) >= 3).long().expand(2, 10))  # left-padded: 7 real tokens a row
    assert counter.flops["held_out"] == pass_flops(cfg, 2, 10) + pass_flops(cfg, 2, 7, lm_head=False)
    assert counter.total == sum(counter.flops.values())


def test_frozen_weights_get_no_weight_gradients_counted():
    """With only the final norm training (as LoRA trains its adapters alone), the backward pass counts the input
    gradients and that share's weight gradients."""
    cfg = get_preset("tiny")
    model = GPTModel(cfg)
    model.requires_grad_(False)
    model.final_norm.requires_grad_(True)
    share = 2 * cfg.emb_dim / sum(p.numel() for p in model.parameters())
    counter = FlopCounter(model)
    ids = torch.randint(5, 100, (1, 8))
    model(ids, labels=ids)["loss"].backward()
    assert counter.flops == {"train": pass_flops(cfg, 1, 8, trained_share=share)}


def test_the_matmul_yardstick_is_a_rate():
    assert 0 < matmul_flop_s(torch.device("cpu"), size=64, repeats=2) < float("inf")


def test_a_speed_record_and_its_cell():
    """2e10 FLOPs in 2 s on a CPU are 10 GFLOP/s; against a 40 GFLOP/s product, a quarter; with a peak, the MFU."""
    record = speed_record({"train": 1.5e10, "sample": 0.5e10}, 2.0, torch.device("cpu"))
    assert record == {"flops": {"sample": 0.5e10, "train": 1.5e10}, "flop_s": 1e10}
    assert format_speed({**record, "matmul_flop_s": 4e10, "peak_flops": None}) == "10 GFLOP/s (25% of a matmul)"
    assert format_speed({**record, "matmul_flop_s": 4e10, "peak_flops": 1e12}) == "10 GFLOP/s (MFU 1.0%)"
    assert format_speed({}) == "—"
    measured = speed_record({"train": 1}, 1.0, torch.device("cpu"), torch.float32)
    assert measured["matmul_flop_s"] > 0 and measured["peak_flops"] is None


def test_every_share_on_the_card_is_of_the_fastest_matmul_the_run_measured_in_that_precision():
    """A yardstick measured in a slow second (SFT: 1e10 against 4e10) would give SFT 100%; the card reads every stage
    of one device and precision against the run's fastest (4e10), so both show 25%, and a bf16 stage its own."""
    from plumbing.report import best_matmul, with_yardstick

    def config(matmul, precision):
        return {"config": {"flop_s": 1e10, "matmul_flop_s": matmul, "device": "cpu", "mixed_precision": precision}}

    records = {"pretrain": config(4e10, "no"), "sft": config(1e10, "no"), "rm": config(8e10, "bf16")}
    best_of_n = {"speed": {"flop_s": 1e10, "matmul_flop_s": 2e10}}  # generate.py: fp32 on the CPU
    best = best_matmul(records, best_of_n)
    assert best == {("cpu", "no"): 4e10, ("cpu", "bf16"): 8e10}
    cells = [format_speed(with_yardstick(r["config"], best)) for r in records.values()]
    assert cells == ["10 GFLOP/s (25% of a matmul)", "10 GFLOP/s (25% of a matmul)", "10 GFLOP/s (12% of a matmul)"]
    assert format_speed(with_yardstick(best_of_n["speed"], best)) == "10 GFLOP/s (25% of a matmul)"
    assert with_yardstick({"flop_s": 1e10}, best) == {"flop_s": 1e10}  # no yardstick of its own: none given
