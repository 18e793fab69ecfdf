"""Tests of load_weight.py against ``transformers.GPT2LMHeadModel`` holding the same weights (the other
architectures, GPT-NeoX and Arcee, and the reward model: ``test_hf_export.py``).

Every expected value comes from ``transformers``: small random GPT-2s are built with it, saved in the layouts found
in the wild (uer's old ``pytorch_model.bin`` with ``transformer.`` names, mask buffers and a copy of the tied head;
``save_pretrained`` safetensors; OpenAI's bare ``h.0`` names; an untied head), loaded here, and must give the same
logits and the same greedy continuations. Exports go the other way and are loaded back by ``from_pretrained``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

import load_weight
from chinese_tokenizer import encode
from gpt_model import GPTConfig, GPTModel, generate
from plumbing.checkpoint import load_checkpoint
from plumbing.cli import UserError, run

REPO_ROOT = Path(__file__).resolve().parent.parent
CTX, EMB, LAYERS, HEADS = 32, 32, 2, 2


pytestmark = pytest.mark.usefixtures("quiet_single_thread")  # conftest.py


# --------------------------------------------------------------------------------------------------------------
# HF GPT-2s on disk


def random_hf_gpt2(vocab_size, seed, tie=True, **config):
    """A ``GPT2LMHeadModel`` with every parameter random and large enough that logits are well spread (the default
    init gives nearly flat logits, where greedy ties and small mapping errors would go unnoticed)."""
    settings = dict(vocab_size=vocab_size, n_positions=CTX, n_embd=EMB, n_layer=LAYERS, n_head=HEADS,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
                    bos_token_id=None, eos_token_id=None)
    cfg = GPT2Config(**{**settings, **config})
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model.eval()


def hf_tensors(model):
    """The model's tensors under ``transformers``' names (``transformer.h.0...``), tied head left out."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_config(directory, model, **overrides):
    config = model.config.to_dict()
    config.update(overrides)
    Path(directory, "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def save_uer_style_bin(model, directory):
    """The layout of uer/gpt2-chinese-cluecorpussmall's pytorch_model.bin (saved by transformers 4.x): names with
    ``transformer.``, the causal-mask buffers ``attn.bias``/``attn.masked_bias``, and a copy of the tied head; its
    config.json says bos/eos 50256 although the vocabulary has 21128 ids."""
    os.makedirs(directory, exist_ok=True)
    state = hf_tensors(model)
    for i in range(model.config.n_layer):
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(CTX, CTX, dtype=torch.uint8)).view(1, 1, CTX, CTX)
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    torch.save(state, os.path.join(directory, "pytorch_model.bin"))
    write_config(directory, model, bos_token_id=50256, eos_token_id=50256, n_ctx=CTX,
                 tokenizer_class="BertTokenizer", architectures=["GPT2LMHeadModel"])
    shutil.copy(REPO_ROOT / "data" / "tokenizer" / "vocab.txt", directory)  # uer ships the plain BERT vocab.txt


def save_bare_safetensors(model, directory):
    """OpenAI's gpt2 ``model.safetensors`` layout: bare ``h.0...``/``wte.weight`` names (a ``GPT2Model``)."""
    os.makedirs(directory, exist_ok=True)
    state = {k.removeprefix("transformer."): v for k, v in hf_tensors(model).items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    write_config(directory, model)


def save_with_transformers(model, directory):
    model.save_pretrained(directory)  # model.safetensors with transformer.* names


@pytest.fixture(scope="module")
def uer_like(tokenizer, tmp_path_factory):
    """(HF model, directory) shaped like uer: our 21128-id vocabulary, q/k/v biases, tied head, a .bin file."""
    model = random_hf_gpt2(21128, seed=0)
    directory = tmp_path_factory.mktemp("uer") / "gpt2-chinese"
    save_uer_style_bin(model, directory)
    return model, str(directory)


VARIANTS = {
    # name: (vocab, tie, saver)
    "uer-bin": (21128, True, save_uer_style_bin),
    "uer-safetensors": (21128, True, save_with_transformers),
    "openai-bare-safetensors": (50257, True, save_bare_safetensors),
    "untied-head": (1000, False, save_with_transformers),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_variant(request, tokenizer, tmp_path_factory):
    vocab, tie, saver = VARIANTS[request.param]
    model = random_hf_gpt2(vocab, seed=len(request.param), tie=tie)
    directory = tmp_path_factory.mktemp(request.param) / "model"
    saver(model, str(directory))
    return model, str(directory)


def sample_ids(vocab_size, batch, length, seed=1):
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------------
# Hugging Face -> GPTModel


def test_load_matches_transformers_logits_and_greedy(hf_variant):
    hf, directory = hf_variant
    ours = load_weight.load_hf_model(directory)
    ids = sample_ids(hf.config.vocab_size, batch=2, length=CTX)  # every position of the table
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], hf(ids).logits, atol=1e-4, rtol=1e-4)

    prompt = ids[:1, :5]
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    got = generate(ours, prompt, max_new_tokens=12, context_size=ours.cfg.context_length)
    assert got.tolist() == expected.tolist()


def test_config_fields_are_read(tmp_path):
    hf = random_hf_gpt2(500, seed=3, tie=False, layer_norm_epsilon=1e-3, resid_pdrop=0.05)
    save_with_transformers(hf, tmp_path)
    cfg = load_weight.load_hf_model(str(tmp_path)).cfg
    assert (cfg.vocab_size, cfg.context_length, cfg.emb_dim, cfg.n_heads, cfg.n_layers) == (500, CTX, EMB, HEADS,
                                                                                           LAYERS)
    assert (cfg.layer_norm_eps, cfg.drop_rate, cfg.qkv_bias, cfg.tie_embeddings) == (1e-3, 0.05, True, False)
    assert cfg.bos_id is None  # not the BERT-Chinese vocabulary: no [CLS] convention to follow


def test_uer_style_bin_keeps_tied_head_and_ignores_buffers(uer_like):
    hf, directory = uer_like
    ours = load_weight.load_hf_model(directory)
    assert ours.cfg == GPTConfig(vocab_size=21128, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=LAYERS,
                                 drop_rate=0.0, qkv_bias=True, tie_embeddings=True, bos_id=101)  # uer: [CLS] text
    assert ours.out_head.weight is ours.tok_emb.weight
    torch.testing.assert_close(ours.tok_emb.weight, hf.transformer.wte.weight, atol=0, rtol=0)
    assert not ours.training


def test_half_precision_weights_are_widened(tmp_path):
    hf = random_hf_gpt2(300, seed=4)
    save_file({k: v.half() for k, v in hf_tensors(hf).items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    write_config(tmp_path, hf)
    ours = load_weight.load_hf_model(str(tmp_path))
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    torch.testing.assert_close(ours.tok_emb.weight, hf.transformer.wte.weight.half().float(), atol=0, rtol=0)


def test_sharded_safetensors_load(tmp_path):
    hf = random_hf_gpt2(300, seed=5)
    state = hf_tensors(hf)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    write_config(tmp_path, hf)
    ids = sample_ids(300, 1, 10)
    with torch.no_grad():
        torch.testing.assert_close(load_weight.load_hf_model(str(tmp_path))(ids)["logits"], hf(ids).logits,
                                   atol=1e-4, rtol=1e-4)


class WritesMarker:
    """A pickled object whose loading creates a directory: what a malicious pytorch_model.bin would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    hf = random_hf_gpt2(300, seed=6)
    marker = tmp_path / "code-ran"
    state = dict(hf_tensors(hf), payload=WritesMarker(str(marker)))
    torch.save(state, str(tmp_path / "pytorch_model.bin"))
    write_config(tmp_path, hf)
    with pytest.raises(UserError, match="refusing to load .*pytorch_model.bin"):
        load_weight.load_hf_model(str(tmp_path))
    assert not marker.exists()
    # the payload is live: an ordinary unpickling runs it (so the assertion above can fail)
    torch.load(str(tmp_path / "pytorch_model.bin"), weights_only=False)
    assert marker.exists()


def test_missing_and_unknown_weights_are_listed(tmp_path):
    hf = random_hf_gpt2(300, seed=7)
    state = hf_tensors(hf)
    del state["transformer.h.1.mlp.c_fc.weight"]
    state["transformer.h.0.attn.rotary.weight"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    write_config(tmp_path, hf)
    with pytest.raises(UserError) as e:
        load_weight.load_hf_model(str(tmp_path))
    message = str(e.value)
    assert "missing 1 weights (h.1.mlp.c_fc.weight)" in message
    assert "1 unknown weights (h.0.attn.rotary.weight)" in message
    assert "\n" not in message


def test_config_with_more_layers_than_the_weights(tmp_path):
    hf = random_hf_gpt2(300, seed=8)
    save_with_transformers(hf, tmp_path)
    write_config(tmp_path, hf, n_layer=3)
    with pytest.raises(UserError, match=r"missing 12 weights \(h\.2\.attn\.c_attn\.bias, h\.2\.attn\.c_attn\.weight"):
        load_weight.load_hf_model(str(tmp_path))


def test_gpt2_file_without_qkv_biases_loads(tmp_path):
    hf = random_hf_gpt2(300, seed=13)
    state = {k: v for k, v in hf_tensors(hf).items() if not k.endswith("c_attn.bias")}
    with torch.no_grad():
        for block in hf.transformer.h:
            block.attn.c_attn.bias.zero_()  # what the file without them computes
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    write_config(tmp_path, hf)
    ours = load_weight.load_hf_model(str(tmp_path))
    assert not ours.cfg.qkv_bias
    ids = sample_ids(300, 2, CTX)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_shape_disagreeing_with_config(tmp_path):
    hf = random_hf_gpt2(300, seed=9)
    save_with_transformers(hf, tmp_path)
    write_config(tmp_path, hf, n_positions=64)
    with pytest.raises(UserError, match=r"pos_emb.weight has shape \(32, 32\) .* implies \(64, 32\)"):
        load_weight.load_hf_model(str(tmp_path))


@pytest.mark.parametrize("override, words", [
    ({"activation_function": "relu"}, "activation_function is 'relu'"),
    ({"n_inner": 3 * EMB}, "n_inner is 96"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"model_type": "bert"}, "'bert' model"),
    ({"n_head": 5}, "emb_dim=32 must be divisible by n_heads=5"),
])
def test_configs_our_model_cannot_reproduce_are_refused(tmp_path, override, words):
    hf = random_hf_gpt2(300, seed=10)
    save_with_transformers(hf, tmp_path)
    write_config(tmp_path, hf, **override)
    with pytest.raises(UserError, match="config.json") as e:
        load_weight.load_hf_model(str(tmp_path))
    assert words in str(e.value)


def test_bad_directories(tmp_path):
    with pytest.raises(UserError, match="not a local directory.*hf download"):
        load_weight.load_hf_model(str(tmp_path / "uer" / "gpt2-chinese-cluecorpussmall"))
    with pytest.raises(UserError, match="no config.json"):
        load_weight.load_hf_model(str(tmp_path))
    hf = random_hf_gpt2(300, seed=11)
    write_config(tmp_path, hf)
    with pytest.raises(UserError, match="no model.safetensors or pytorch_model.bin"):
        load_weight.load_hf_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_weight.load_hf_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "stage": "pretrain"}))
    with pytest.raises(UserError, match="checkpoint of this project.*--init"):
        load_weight.load_hf_model(str(tmp_path))


# --------------------------------------------------------------------------------------------------------------
# GPTModel -> Hugging Face


def random_gpt(cfg, seed=0):
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("scale") else p.normal_(0.0, 0.3)
    return model.eval()


def test_export_loads_in_transformers_with_same_logits(tmp_path, tokenizer):
    ours = random_gpt(GPTConfig(context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=LAYERS, drop_rate=0.0))
    out = tmp_path / "hf"
    load_weight.save_hf_model(ours, str(out), tokenizer)
    hf = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = sample_ids(21128, 2, CTX)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids)["logits"], atol=1e-4, rtol=1e-4)
    prompt = ids[:1, :5]
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                           eos_token_id=None)
    assert generate(ours, prompt, 10, CTX).tolist() == expected.tolist()

    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (101, 102, 0)
    assert config["activation_function"] == "gelu_new"
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == (101, 102)
    text = "今天天气很好。\n“走吧”"
    assert AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"] == encode(text,
                                                                                                        tokenizer)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary directory left behind


def test_export_then_import_is_exact_untied_with_qkv_bias(tmp_path):
    cfg = GPTConfig(vocab_size=400, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=LAYERS, drop_rate=0.1,
                    qkv_bias=True, tie_embeddings=False, layer_norm_eps=1e-6)
    ours = random_gpt(cfg, seed=1)
    load_weight.save_hf_model(ours, str(tmp_path / "hf"))
    back = load_weight.load_hf_model(str(tmp_path / "hf"))
    assert back.cfg == cfg
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert "bos_token_id" not in json.loads((tmp_path / "hf" / "config.json").read_text())  # unknown vocabulary


def test_export_without_qkv_bias_writes_zero_biases(tmp_path):
    ours = random_gpt(GPTConfig(vocab_size=300, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=1,
                                drop_rate=0.0))
    load_weight.save_hf_model(ours, str(tmp_path / "hf"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert torch.count_nonzero(hf.transformer.h[0].attn.c_attn.bias) == 0
    ids = sample_ids(300, 1, CTX)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids)["logits"], atol=1e-4, rtol=1e-4)


def test_export_refuses_to_replace_unless_asked(tmp_path):
    ours = random_gpt(GPTConfig(vocab_size=300, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=1))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        load_weight.save_hf_model(ours, str(out))
    assert (out / "keep.txt").exists()
    load_weight.save_hf_model(ours, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# --------------------------------------------------------------------------------------------------------------
# command line


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run(load_weight.main, argv)
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys, uer_like):
    code, _, err = run_cli(["--from_hf", str(tmp_path / "nowhere"), "--to_checkpoint", str(tmp_path / "ck")], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "nowhere" in err

    openai = random_hf_gpt2(50257, seed=12)
    save_bare_safetensors(openai, str(tmp_path / "openai"))
    code, _, err = run_cli(["--from_hf", str(tmp_path / "openai"), "--to_checkpoint", str(tmp_path / "ck")], capsys)
    assert code == 2 and "vocab_size is 50257" in err and err.count("\n") == 1
    assert not (tmp_path / "ck").exists()

    code, _, err = run_cli(["--checkpoint", str(tmp_path / "ck")], capsys)
    assert code == 2 and "--to_hf" in err

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("user data")
    _, directory = uer_like
    code, _, err = run_cli(["--from_hf", directory, "--to_checkpoint", str(tmp_path / "ck")], capsys)
    assert code == 2 and "already exists; pass --overwrite" in err
    assert (tmp_path / "ck" / "notes.txt").exists()
    code, out, _ = run_cli(["--from_hf", directory, "--to_checkpoint", str(tmp_path / "ck"), "--overwrite"], capsys)
    assert code == 0 and "wrote" in out and not (tmp_path / "ck" / "notes.txt").exists()


def test_cli_help_shows_the_uer_recipe(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    assert "hf download uer/gpt2-chinese-cluecorpussmall --local-dir" in out
    assert "0-PRETRAIN.py --init_from_hf" in out


@pytest.mark.slow
def test_cli_round_trip_through_a_stage_checkpoint(tmp_path, uer_like):
    hf, directory = uer_like
    ck, out = tmp_path / "ck", tmp_path / "hf-out"
    script = str(REPO_ROOT / "load_weight.py")
    done = subprocess.run([sys.executable, script, "--from_hf", directory, "--to_checkpoint", str(ck)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    model, tok, config = load_checkpoint(str(ck))
    assert config["stage"] == "hf-import" and config["parent"] == os.path.abspath(directory)
    assert len(config["parent_sha256"]) == 64 and len(tok) == 21128

    done = subprocess.run([sys.executable, script, "--checkpoint", str(ck), "--to_hf", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    exported = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = sample_ids(21128, 2, CTX)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(ids)["logits"], hf(ids).logits, atol=1e-4, rtol=1e-4)

    done = subprocess.run([sys.executable, script, "--checkpoint", str(ck), "--to_hf", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: --to_hf ") and "--overwrite" in done.stderr


@pytest.mark.slow
def test_pretrain_starts_from_hf_weights(tmp_path, uer_like):
    hf, directory = uer_like
    text = ("中国是世界上历史最悠久的国家之一。人民日报发表社论，回顾一年来的经济建设成就。\n\n"
            "刘备、关羽、张飞在桃园结义，誓同生死，共图大事。曹操挟天子以令诸侯。\n\n") * 6
    (tmp_path / "train.txt").write_text(text, encoding="utf-8")
    (tmp_path / "val.txt").write_text(text[:200], encoding="utf-8")
    out = tmp_path / "pretrain"
    # a learning rate so small that two steps leave the weights where they started
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "0-PRETRAIN.py"), "--init_from_hf", directory, "--preset", "tiny",
         "--max_steps", "2", "--learning_rate", "1e-9", "--batch_size", "2", "--eval_examples", "2",
         "--train_files", str(tmp_path / "train.txt"), "--val_files", str(tmp_path / "val.txt"),
         "--output_dir", str(out), "--tokenizer", str(REPO_ROOT / "data" / "tokenizer")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model, _, config = load_checkpoint(str(out))
    assert config["parent"] == os.path.abspath(directory) and config["step"] == 2
    assert model.cfg.context_length == CTX and model.cfg.qkv_bias
    assert model.cfg.bos_id == 101  # uer's documents start with [CLS]: its pretraining, generation and SFT keep it
    ids = sample_ids(21128, 2, CTX)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)["logits"], hf(ids).logits, atol=1e-4, rtol=1e-4)
