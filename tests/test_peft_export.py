"""LoRA adapters out to ``peft`` (``plumbing/hf_weights.py``: ``peft_adapter``, ``save_peft_adapter``).

The expected values come from ``peft`` and ``transformers`` themselves: the base model exported by
``save_hf_model``, loaded with ``AutoModelForCausalLM`` and wrapped by ``PeftModel.from_pretrained`` over the exported
adapter, must give the logits of our model whose target weights are W + alpha / r * B @ A, merged here by hand (this
file does not use ``lora.py``). The adapters are random and distinct in every target, so an adapter placed in the wrong
rows of a fused projection, in the wrong rotary order or with the wrong scaling fails the comparison.
"""

import copy
import json

import pytest
import torch
from peft import PeftConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gpt_model import GPTConfig, GPTModel
from plumbing import hf_weights
from plumbing.cli import UserError

CTX, EMB, HEADS, LAYERS = 64, 32, 4, 2  # head dimension 8: four rotary pairs per head
ALL = ["att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0", "ff.layers.2"]
DEFAULT = ["att.W_query", "att.W_value"]
ARCHS = {"gpt2": ("layernorm", "learned"), "gpt_neox": ("layernorm", "rope"), "arcee": ("rmsnorm", "rope")}
# (targets, rank, alpha, qkv_bias, tied): two q/v parts fused, three plus everything else, one part (no pattern)
CASES = {"default": (DEFAULT, 4, 6, False, True), "all": (ALL, 2, 5.0, True, False),
         "key-and-ff": (["att.W_key", "ff.layers.2"], 3, 3, True, True)}

pytestmark = pytest.mark.usefixtures("quiet_single_thread")  # conftest.py


def tiny(arch, **changes):
    norm, position = ARCHS[arch]
    return GPTConfig(vocab_size=300, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=LAYERS, drop_rate=0.0,
                     norm=norm, position_embedding=position, **changes)


def randomised(model, seed=0):
    """Every parameter random and large (as in test_hf_export.py), so a wrong mapping shows in the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("scale") else p.normal_(0.0, 0.3)
    return model.eval()


def random_adapters(model, targets, rank, seed=1):
    """The contract's adapter state dict: A (r, in) and B (out, r), random and non-zero, for every block."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(model.cfg.n_layers):
        for target in targets:
            weight = model.get_submodule(f"trf_blocks.{i}.{target}").weight  # (out, in)
            state[f"trf_blocks.{i}.{target}.lora_A"] = 0.1 * torch.randn(rank, weight.shape[1], generator=g)
            state[f"trf_blocks.{i}.{target}.lora_B"] = 0.1 * torch.randn(weight.shape[0], rank, generator=g)
    return state


def merged(model, settings, state):
    """A copy of ``model`` whose target weights are W + alpha / r * B @ A: the reference."""
    reference = copy.deepcopy(model)
    scaling = settings["alpha"] / settings["rank"]
    with torch.no_grad():
        for i in range(model.cfg.n_layers):
            for target in settings["targets"]:
                a, b = state[f"trf_blocks.{i}.{target}.lora_A"], state[f"trf_blocks.{i}.{target}.lora_B"]
                reference.get_submodule(f"trf_blocks.{i}.{target}").weight.add_(scaling * b @ a)
    return reference


def padded_batch(vocab_size, side, seed=1):
    """(ids, attention_mask): three rows of 20, the first two padded on ``side`` by 5 and 9."""
    ids = torch.randint(1, vocab_size, (3, 20), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, pad in ((0, 5), (1, 9)):
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, -pad:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def largest_difference(reference, peft_model):
    """The largest |logit difference| over the real tokens of left- and right-padded batches."""
    worst = 0.0
    for side in ("left", "right"):
        ids, mask = padded_batch(reference.cfg.vocab_size, side)
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # counted from each row's first real token, as generate does
        with torch.no_grad():
            theirs = peft_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            mine = reference(ids, attention_mask=mask)["logits"]
        worst = max(worst, float((theirs - mine)[mask.bool()].abs().max()))
    return worst


def export(tmp_path, model, settings, state):
    """The base model exported by save_hf_model, the adapter beside it; returns (base dir, adapter dir)."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    hf_weights.save_hf_model(model, str(base))
    hf_weights.save_peft_adapter(model.cfg, settings, state, str(adapter), base_model_name_or_path="../base")
    return base, adapter


def load_peft(base, adapter):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_peft_reproduces_the_merged_model(tmp_path, arch, case):
    targets, rank, alpha, qkv_bias, tied = CASES[case]
    model = randomised(GPTModel(tiny(arch, qkv_bias=qkv_bias, tie_embeddings=tied)))
    settings = {"rank": rank, "alpha": alpha, "targets": targets, "dropout": 0.05}
    state = random_adapters(model, targets, rank)
    reference = merged(model, settings, state)
    base, adapter = export(tmp_path, model, settings, state)

    config = PeftConfig.from_pretrained(str(adapter))
    assert config.peft_type == "LORA" and config.task_type == "CAUSAL_LM" and config.r == rank
    assert config.base_model_name_or_path == "../base" and config.fan_in_fan_out == (arch == "gpt2")
    peft_model = load_peft(base, adapter)
    base_only = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    assert largest_difference(model, base_only) <= 1e-4  # the base export is unchanged by the adapter
    assert largest_difference(reference, base_only) > 1e-2  # the adapters matter, so the comparison below can fail
    assert largest_difference(reference, peft_model) <= 1e-4


def test_the_file_names_shapes_and_scaling(tmp_path):
    """GPT-2 with q and v adapted: one c_attn LoRA of rank 2r whose alpha keeps the scaling alpha / r, and the
    names PeftModel.from_pretrained loads (every adapter tensor reaches a LoRA layer)."""
    model = randomised(GPTModel(tiny("gpt2")))
    settings = {"rank": 4, "alpha": 8, "targets": ALL, "dropout": 0.0}
    base, adapter = export(tmp_path, model, settings, random_adapters(model, ALL, 4))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert config["rank_pattern"] == {"attn.c_attn": 12} and config["alpha_pattern"] == {"attn.c_attn": 24}
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (12, EMB)
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (3 * EMB, 12)
    assert tensors["base_model.model.transformer.h.1.mlp.c_fc.lora_A.weight"].shape == (4, EMB)
    assert tensors["base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight"].shape == (4 * EMB, 4)
    assert len(tensors) == LAYERS * 4 * 2
    peft_model = load_peft(base, adapter)
    c_attn = peft_model.base_model.model.transformer.h[0].attn.c_attn
    assert c_attn.scaling["default"] == 8 / 4 and c_attn.r["default"] == 12
    assert peft_model.base_model.model.transformer.h[0].mlp.c_proj.scaling["default"] == 2.0
    loaded = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_fused_delta_is_the_change_of_the_exported_weights(arch):
    """Without peft: scaling * B @ A of every exported module (transposed for GPT-2's Conv1D) is exactly what merging
    the adapters changes in gpt_to_hf_state_dict's weights, row for row."""
    model = randomised(GPTModel(tiny(arch)))
    settings = {"rank": 2, "alpha": 3, "targets": ALL, "dropout": 0.0}
    state = random_adapters(model, ALL, 2)
    config, tensors = hf_weights.peft_adapter(model.cfg, settings, state)
    before, after = hf_weights.gpt_to_hf_state_dict(model)[0], hf_weights.gpt_to_hf_state_dict(
        merged(model, settings, state))[0]
    changed = {k for k in before if not torch.allclose(before[k], after[k], atol=1e-7)}
    assert len(changed) == LAYERS * (4 if arch != "arcee" else 6)
    for name in changed:
        module = name.removesuffix(".weight")
        short = next(m for m in config["target_modules"] if module.endswith("." + m))
        r = config["rank_pattern"].get(short, config["r"])
        alpha = config["alpha_pattern"].get(short, config["lora_alpha"])
        a, b = tensors[f"base_model.model.{module}.lora_A.weight"], tensors[f"base_model.model.{module}.lora_B.weight"]
        delta = alpha / r * b @ a  # (out, in)
        torch.testing.assert_close(after[name] - before[name], delta.t() if arch == "gpt2" else delta,
                                   atol=1e-6, rtol=0)


def test_an_adapter_in_the_wrong_rows_is_caught(tmp_path):
    """The query's adapter exported as the key's (a swap within the fused module) no longer matches."""
    model = randomised(GPTModel(tiny("gpt_neox")))
    settings = {"rank": 4, "alpha": 4, "targets": ["att.W_query", "att.W_value"], "dropout": 0.0}
    state = random_adapters(model, settings["targets"], 4)
    swapped = {k.replace("W_query", "W_key"): v for k, v in state.items()}
    base, adapter = export(tmp_path, model, {**settings, "targets": ["att.W_key", "att.W_value"]}, swapped)
    assert largest_difference(merged(model, settings, state), load_peft(base, adapter)) > 1e-2


@pytest.mark.parametrize("change, words", [
    (lambda s, st: ({**s, "targets": ["att.W_query", "att.c_attn"]}, st), "LoRA targets"),
    (lambda s, st: ({**s, "rank": 0}, st), "rank 0"),
    (lambda s, st: ({k: v for k, v in s.items() if k != "alpha"}, st), "lack alpha"),
    (lambda s, st: (s, {k: v for k, v in st.items() if "1.att.W_value.lora_B" not in k}), "missing 1"),
    (lambda s, st: (s, {**st, "trf_blocks.0.att.W_query.lora_A": torch.zeros(3, EMB)}), "wrong shape"),
    (lambda s, st: (s, {"backbone." + k: v for k, v in st.items()}), "reward model's adapters"),
])
def test_what_cannot_be_exported_is_refused_in_one_line(tmp_path, change, words):
    model = GPTModel(tiny("gpt2"))
    settings = {"rank": 4, "alpha": 8, "targets": DEFAULT, "dropout": 0.0}
    settings, state = change(settings, random_adapters(model, DEFAULT, 4))
    with pytest.raises(UserError, match=words) as e:
        hf_weights.save_peft_adapter(model.cfg, settings, state, str(tmp_path / "adapter"))
    assert "\n" not in str(e.value) and not (tmp_path / "adapter").exists()


def test_refusals_of_the_architecture_and_the_directory(tmp_path):
    learned_rms = GPTConfig(vocab_size=300, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=LAYERS,
                            norm="rmsnorm", position_embedding="learned")
    settings = {"rank": 2, "alpha": 2, "targets": DEFAULT, "dropout": 0.0}
    with pytest.raises(UserError, match="cannot export norm='rmsnorm'"):
        hf_weights.peft_adapter(learned_rms, settings, random_adapters(GPTModel(learned_rms), DEFAULT, 2))
    model = GPTModel(tiny("arcee"))
    state = random_adapters(model, DEFAULT, 2)
    (tmp_path / "adapter").mkdir()
    with pytest.raises(UserError, match="already exists"):
        hf_weights.save_peft_adapter(model.cfg, settings, state, str(tmp_path / "adapter"))
    hf_weights.save_peft_adapter(model.cfg, settings, state, str(tmp_path / "adapter"), overwrite=True)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left behind
