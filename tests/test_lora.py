"""LoRA (lora.py) and adapter checkpoints (plumbing/checkpoint.py), each against values computed independently: the
base model, a hand-written low-rank product, a separate frozen copy, a plain model's names."""

import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lora
from gpt_fast import SplitLinear, speed_up
from gpt_model import GPTConfig, GPTModel, RewardModel, get_preset
from lora import (
    DEFAULT_TARGETS,
    LORA_TARGETS,
    LoRALinear,
    adapters_off,
    add_lora,
    load_lora_state_dict,
    lora_settings,
    lora_state_dict,
    merge_lora,
    parse_targets,
)
from plumbing.checkpoint import (
    file_sha256,
    load_backbone,
    load_checkpoint,
    load_weights_into,
    merge_adapter_checkpoint,
    parent_meta,
    save_checkpoint,
)
from plumbing.cli import UserError

CFG = GPTConfig(vocab_size=61, context_length=16, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0, qkv_bias=True)


def tiny(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return speed_up(GPTModel(cfg)).eval()  # as the stages run it: LoRA adapts the fast layers


def ids(cfg=CFG, seed=1):
    return torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))


def train_adapters(model, steps=3, seed=2):
    """A few plain SGD steps on the next-token loss of random ids, so that A and B move away from their start."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x = ids(model.cfg, seed)
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    model.train()
    for _ in range(steps):
        model(x, labels=labels)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def log_probs(model, x, mask=None):
    return torch.log_softmax(model(x, attention_mask=mask)["logits"], dim=-1)


# --- the layer ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("targets", [DEFAULT_TARGETS, "all"])
def test_step_zero_is_exactly_the_base_model(targets):
    model = tiny()
    x = ids()
    with torch.no_grad():  # SplitLinear.s CPU decoding path (split_linear) for one row, F.linear for the rest
        before, before_row = model(x)["logits"], model(x[:1, :1])["logits"]
    before_grad = model(x)["logits"].detach()
    add_lora(model, rank=4, alpha=8, targets=targets)
    assert len(lora.lora_layers(model)) == CFG.n_layers * (6 if targets == "all" else 2)
    assert not any(m.training for m in model.modules())  # the new layers (and their dropout) follow eval mode
    with torch.no_grad():
        assert torch.equal(model(x)["logits"], before)
        assert torch.equal(model(x[:1, :1])["logits"], before_row)
    assert torch.equal(model(x)["logits"].detach(), before_grad)


def test_lora_delta_is_the_low_rank_product_by_hand():
    torch.manual_seed(0)
    base = SplitLinear(6, 5).double()
    layer = LoRALinear(base, rank=3, alpha=6)
    assert layer.weight is base.weight and layer.bias is base.bias  # the same Parameters, not copies
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 4, 6, dtype=torch.float64)  # (B, T, in)
    A, B = layer.lora_A.detach(), layer.lora_B.detach()  # (r, in), (out, r)
    by_hand = torch.zeros(2, 4, 5, dtype=torch.float64)
    for b in range(2):
        for t in range(4):
            for o in range(5):
                by_hand[b, t, o] = sum(B[o, k] * sum(A[k, i] * x[b, t, i] for i in range(6)) for k in range(3))
    delta = layer(x) - (x @ base.weight.T + base.bias)  # (B, T, out)
    assert torch.allclose(delta, (6 / 3) * by_hand, atol=1e-12)
    assert torch.allclose(layer.delta_weight(), 2.0 * B @ A, atol=1e-12)


def test_initialisation_a_kaiming_uniform_b_zero():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(300, 40), rank=64, alpha=16)
    bound = 1 / math.sqrt(300)  # kaiming_uniform_(a=sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in))
    a = layer.lora_A.detach()
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    assert abs(a.std().item() - bound / math.sqrt(3)) < 0.03 * bound  # the std of U(-b, b) is b / sqrt(3)
    assert torch.equal(layer.lora_B, torch.zeros(40, 64)) and layer.scaling == 16 / 64
    assert layer.lora_A.requires_grad and layer.lora_B.requires_grad


def test_dropout_is_on_the_adapter_input_only():
    torch.manual_seed(0)
    base = SplitLinear(8, 6)
    layer = LoRALinear(base, rank=2, alpha=2, dropout=0.5)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 8)
    torch.manual_seed(5)
    out = layer(x)
    torch.manual_seed(5)
    dropped = F.dropout(x, 0.5, training=True)  # the same mask, drawn from the same seed
    expected = F.linear(x, base.weight, base.bias) + (dropped @ layer.lora_A.T @ layer.lora_B.T)
    assert torch.allclose(out, expected, atol=1e-6)
    layer.eval()
    assert torch.allclose(layer(x), F.linear(x, base.weight, base.bias) + x @ layer.lora_A.T @ layer.lora_B.T,
                          atol=1e-6)


def test_merged_equals_unmerged_and_unmerge_restores_the_base():
    model = add_lora(tiny(), rank=4, alpha=8, targets="all")
    base_weights = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".weight")}
    # a manual gradient step on the adapters (two, so that A moves too: its gradient is zero while B is)
    x = ids()
    for _ in range(2):
        model(x)["logits"].pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 10.0 * p.grad
                    p.grad = None
    unmerged = model(x)["logits"].detach()
    assert not torch.allclose(unmerged, tiny()(x)["logits"].detach(), atol=1e-3)  # the adapters do something
    for layer in lora.lora_layers(model):
        layer.merge()
    assert torch.allclose(model(x)["logits"].detach(), unmerged, atol=1e-5)
    with pytest.raises(ValueError, match="merged already"):
        model.trf_blocks[0].att.W_query.merge()
    for layer in lora.lora_layers(model):
        layer.unmerge()
    for name, p in model.named_parameters():
        if name in base_weights:
            assert torch.allclose(p, base_weights[name], atol=1e-6), name
    assert torch.allclose(model(x)["logits"].detach(), unmerged, atol=1e-5)


def test_only_the_adapters_receive_gradients_and_change():
    model = tiny(CFG.replace(tie_embeddings=True)).train()
    add_lora(model, rank=4, alpha=8)
    assert model.out_head.weight is model.tok_emb.weight  # the tie survives
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # every parameter, frozen or not
    x = ids()
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    for _ in range(2):
        model(x, labels=labels)["loss"].backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None) == name.endswith((".lora_A", ".lora_B")), name
        optimizer.step()
        optimizer.zero_grad()
    adapters = [n for n in before if n.endswith((".lora_A", ".lora_B"))]
    assert sorted(adapters) == sorted(f"trf_blocks.{i}.{t}.{ab}" for i in range(2) for t in DEFAULT_TARGETS
                                      for ab in ("lora_A", "lora_B"))
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"{name} changed"
    assert torch.equal(model.out_head.weight, before["tok_emb.weight"])
    assert lora.trainable_parameters(model) == sum(before[n].numel() for n in adapters)


def test_adapters_off_gives_the_log_probs_of_a_separate_frozen_copy():
    model = tiny()
    reference = copy.deepcopy(model).requires_grad_(False)  # the second copy that adapters_off replaces
    train_adapters(add_lora(model, rank=4, alpha=16, targets="all"))
    x = ids(seed=3)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # a left-padded row, as policies see in a batch
    grads_before = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        expected = log_probs(reference, x, mask)
        assert not torch.allclose(log_probs(model, x, mask), expected, atol=1e-3)  # trained away from the base
        with adapters_off(model):
            assert torch.equal(log_probs(model, x, mask), expected)
    with adapters_off(model):  # with autograd on (F.linear rather than the decoding path) too
        assert torch.allclose(log_probs(model, x, mask), log_probs(reference, x, mask), atol=1e-6)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads_before
    assert all(layer.enabled for layer in lora.lora_layers(model))
    with pytest.raises(RuntimeError), adapters_off(model):
        raise RuntimeError("inside")
    assert all(layer.enabled for layer in lora.lora_layers(model))  # restored after an exception too
    model.trf_blocks[0].att.W_query.merge()
    with pytest.raises(ValueError, match="unmerge"), adapters_off(model):
        pass


def test_merge_lora_gives_a_plain_model_with_the_same_logits():
    model = train_adapters(add_lora(tiny(), rank=4, alpha=8, targets="all"))
    x = ids()
    adapted = model(x)["logits"].detach()
    merged = merge_lora(copy.deepcopy(model))
    assert list(merged.state_dict()) == list(GPTModel(CFG).state_dict())
    assert not lora.has_lora(merged) and type(merged.trf_blocks[1].ff.layers[2]) is nn.Linear
    assert all(p.requires_grad for p in merged.parameters())
    assert torch.allclose(merged(x)["logits"].detach(), adapted, atol=1e-5)


def test_a_reward_model_gets_adapters_in_its_backbone():
    torch.manual_seed(0)
    rm = RewardModel(CFG).eval()
    x = ids()
    before = rm(x)["rewards"]
    add_lora(rm, rank=2, alpha=4)
    assert torch.equal(rm(x)["rewards"], before)
    assert sorted(lora_state_dict(rm))[0] == "backbone.trf_blocks.0.att.W_query.lora_A"
    assert not any(p.requires_grad for p in rm.head.parameters())
    assert lora_settings(rm) == {"rank": 2, "alpha": 4, "targets": list(DEFAULT_TARGETS), "dropout": 0.0}


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        add_lora(tiny(), rank=0, alpha=8)
    with pytest.raises(ValueError, match="alpha must be > 0, got -1"):
        add_lora(tiny(), rank=4, alpha=-1)
    with pytest.raises(ValueError, match=r"unknown LoRA target 'W_foo'; choose from att\.W_query"):
        add_lora(tiny(), rank=4, alpha=8, targets=("W_query", "W_foo"))
    with pytest.raises(ValueError, match="unknown LoRA target 'mlp'"):
        parse_targets("W_query,mlp")
    model = add_lora(tiny(), rank=4, alpha=8)
    with pytest.raises(ValueError, match="already"):
        add_lora(model, rank=4, alpha=8)
    assert parse_targets("all") == LORA_TARGETS
    assert parse_targets("W_value, W_query") == parse_targets("att.W_query,att.W_value") == DEFAULT_TARGETS
    assert parse_targets("ff.layers.2,out_proj") == ("att.out_proj", "ff.layers.2")


def test_loading_adapter_tensors_is_strict():
    source = train_adapters(add_lora(tiny(), rank=4, alpha=8))
    state = {n: t.clone() for n, t in lora_state_dict(source).items()}
    assert all(n.endswith((".lora_A", ".lora_B")) for n in state) and len(state) == 2 * 2 * CFG.n_layers
    target = add_lora(tiny(), rank=4, alpha=8)
    load_lora_state_dict(target, state)
    x = ids()
    assert torch.equal(target(x)["logits"], source(x)["logits"])
    with pytest.raises(ValueError, match=r"missing \['trf_blocks.0.att.W_query.lora_A'\]"):
        load_lora_state_dict(target, {n: t for n, t in state.items() if n != "trf_blocks.0.att.W_query.lora_A"})
    with pytest.raises(ValueError, match=r"unexpected \['trf_blocks.0.att.W_key.lora_A'\]"):
        load_lora_state_dict(target, {**state, "trf_blocks.0.att.W_key.lora_A": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="has shape"):
        load_lora_state_dict(add_lora(tiny(), rank=2, alpha=8), state)


# --- adapter checkpoints --------------------------------------------------------------------------------------------

def test_adapter_checkpoint_round_trip_merge_and_a_changed_base(tmp_path, tokenizer):
    cfg = get_preset("tiny")  # the project tokenizer's 21128 ids
    base_dir, adapter_dir, merged_dir = tmp_path / "base", tmp_path / "sft-lora", tmp_path / "sft-merged"
    model = tiny(cfg)
    save_checkpoint(str(base_dir), model, tokenizer, {"stage": "pretrain"})
    add_lora(model, rank=4, alpha=8, targets="W_query,W_value,ff.layers.0")
    with torch.no_grad():
        for layer in lora.lora_layers(model):
            layer.lora_B.normal_(std=0.05)  # as if trained
    save_checkpoint(str(adapter_dir), model, tokenizer, {"stage": "sft", **parent_meta(str(base_dir))})

    assert not (adapter_dir / "model.safetensors").exists() and (adapter_dir / "adapter.safetensors").is_file()
    config = json.loads((adapter_dir / "config.json").read_text())
    assert config["lora"] == {"rank": 4, "alpha": 8, "targets": ["att.W_query", "att.W_value", "ff.layers.0"],
                              "dropout": 0.0}
    assert config["base"] == str(base_dir) and config["base_relative"] == "../base"
    assert config["base_sha256"] == file_sha256(str(base_dir / "model.safetensors"))
    assert config["model_type"] == "gpt" and config["model"] == cfg.to_dict()
    assert (adapter_dir / "tokenizer").is_dir()

    x = ids(cfg)
    expected = model(x)["logits"]
    loaded, _, _ = load_checkpoint(str(adapter_dir), "gpt")
    assert sorted(lora_state_dict(loaded)) == sorted(lora_state_dict(model))
    assert torch.equal(loaded(x)["logits"], expected)

    merge_adapter_checkpoint(str(adapter_dir), str(merged_dir))
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "adapter.safetensors").exists()
    merged, _, merged_config = load_checkpoint(str(merged_dir), "gpt")
    assert not lora.has_lora(merged) and "lora" not in merged_config and merged_config["stage"] == "sft"
    assert merged_config["merged_from"]["base_sha256"] == config["base_sha256"]
    assert torch.allclose(merged(x)["logits"], expected, atol=1e-5)
    with pytest.raises(UserError, match="already holds a checkpoint"):
        merge_adapter_checkpoint(str(adapter_dir), str(merged_dir))
    with pytest.raises(UserError, match="not an adapter checkpoint"):
        merge_adapter_checkpoint(str(merged_dir), str(tmp_path / "again"))

    # the two moved together: the base is found beside the adapter (base_relative), its hash still checked
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(str(base_dir), str(moved / "base"))
    shutil.move(str(adapter_dir), str(moved / "sft-lora"))
    assert torch.equal(load_checkpoint(str(moved / "sft-lora"))[0](x)["logits"], expected)
    shutil.rmtree(moved / "base")
    with pytest.raises(UserError, match="is not there"):
        load_checkpoint(str(moved / "sft-lora"))

    # another base where the adapter's base was: refused in one line naming both paths
    save_checkpoint(str(moved / "base"), tiny(cfg, seed=7), tokenizer, {"stage": "pretrain"})
    with pytest.raises(UserError) as refused:
        load_checkpoint(str(moved / "sft-lora"))
    message = str(refused.value)
    assert "\n" not in message and "trained on another base" in message and "retrain the adapter" in message
    assert str(moved / "sft-lora") in message and str(moved / "base") in message


def test_resume_and_a_stage_after_a_lora_stage(tmp_path, tokenizer):
    cfg = get_preset("tiny")
    base_dir, first_dir, second_dir = tmp_path / "sft", tmp_path / "dpo-lora", tmp_path / "grpo-lora"
    model = tiny(cfg)
    save_checkpoint(str(base_dir), model, tokenizer, {"stage": "sft"})
    train_adapters(add_lora(model, rank=2, alpha=4), steps=2)
    save_checkpoint(str(first_dir), model, tokenizer, {"stage": "dpo", **parent_meta(str(base_dir))})
    x = ids(cfg)
    expected = model(x)["logits"]

    # --resume: the same adapters take the saved values; a run without them is told which flags to pass
    resumed = add_lora(load_backbone(str(base_dir), "--init", tokenizer, "0-PRETRAIN.py")[0], rank=2, alpha=4)
    load_weights_into(resumed, str(first_dir))
    assert torch.equal(resumed.eval()(x)["logits"], expected)
    with pytest.raises(UserError, match="--lora_rank"):
        load_weights_into(tiny(cfg), str(first_dir))

    # the next stage starts from the adapter checkpoint merged, a plain trainable model, and adds its own adapters
    start, parent = load_backbone(str(first_dir), "--policy", tokenizer, "1-SFT.py")
    assert not lora.has_lora(start) and all(p.requires_grad for p in start.parameters())
    assert parent["parent_sha256"] == file_sha256(str(first_dir / "adapter.safetensors"))
    assert torch.allclose(start.eval()(x)["logits"], expected, atol=1e-5)
    train_adapters(add_lora(start, rank=2, alpha=4, targets="all"), steps=1)
    save_checkpoint(str(second_dir), start, tokenizer, {"stage": "grpo", **parent})
    assert torch.equal(load_checkpoint(str(second_dir))[0](x)["logits"], start(x)["logits"])
