"""plumbing/flops.py: training FLOPs per token against a count made by hand, and the GPU peak table."""

import pytest

from gpt_model import GPTModel, get_preset
from plumbing.flops import bf16_peak, format_utilisation, matmul_parameters, training_flops_per_token, utilisation


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
    assert format_utilisation(utilisation(1e9, 400_000, 989.4e12)) == "400 TFLOP/s (MFU 40.4%)"
    assert format_utilisation(utilisation(4e6, 5000, None)) == "20 GFLOP/s"
    assert "mfu" not in utilisation(1.0, 1.0, None)
