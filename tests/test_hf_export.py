"""Every configuration ``gpt_model.py`` builds, out to ``transformers`` and back (``plumbing/hf_weights.py``).

The expected values come from ``transformers`` itself: an export must load with ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification`` and give our logits, greedy tokens and rewards; models built by
``transformers`` with random weights (not by our exporter) must import and give theirs. GPT-2's own cases (uer's
and OpenAI's layouts) are in ``test_load_weight.py``.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
)

from chinese_tokenizer import CHAT_TEMPLATE, chat_messages_ids, load_tokenizer
from gpt_model import GPTConfig, GPTModel, RewardModel, generate
from plumbing import hf_weights
from plumbing.checkpoint import load_checkpoint, save_checkpoint
from plumbing.cli import UserError
from plumbing.reward import score_texts

REPO_ROOT = Path(__file__).resolve().parent.parent
CTX, EMB, HEADS, LAYERS = 64, 32, 4, 2  # head dimension 8: four rotary pairs per head
COMBOS = [(norm, position) for norm in ("layernorm", "rmsnorm") for position in ("learned", "rope")]
EXPECTED = {("layernorm", "learned"): "GPT2LMHeadModel", ("layernorm", "rope"): "GPTNeoXForCausalLM",
            ("rmsnorm", "rope"): "ArceeForCausalLM"}


pytestmark = pytest.mark.usefixtures("quiet_single_thread")  # conftest.py


def randomised(model, seed=0):
    """Every parameter random and large, so logits are spread and a wrong mapping shows (the default init gives
    nearly flat logits, where greedy ties hide errors)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("scale") else p.normal_(0.0, 0.3)
    return model.eval()


def tiny(norm, position, vocab_size=300, **changes):
    return GPTConfig(vocab_size=vocab_size, context_length=CTX, emb_dim=EMB, n_heads=HEADS, n_layers=LAYERS,
                     drop_rate=0.0, norm=norm, position_embedding=position, **changes)


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


def positions(mask):
    """Position ids counted from each row's first real token, as ``transformers``' ``generate`` passes them."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def same_weights(a, b, skip=()):
    return all(torch.equal(x, b.state_dict()[name]) for name, x in a.state_dict().items()
               if not any(s in name for s in skip))


# --------------------------------------------------------------------------------------------------------------
# language models


@pytest.mark.parametrize("qkv_bias, tied", [(False, True), (True, False)], ids=["tied", "untied-qkv-bias"])
@pytest.mark.parametrize("norm, position", COMBOS, ids=[f"{n}-{p}" for n, p in COMBOS])
def test_each_configuration_exports_exactly_or_is_refused(tmp_path, norm, position, qkv_bias, tied):
    cfg = tiny(norm, position, qkv_bias=qkv_bias, tie_embeddings=tied)
    ours = randomised(GPTModel(cfg))
    out = tmp_path / "hf"
    if (norm, position) not in EXPECTED:
        with pytest.raises(UserError) as e:
            hf_weights.save_hf_model(ours, str(out))
        message = str(e.value)
        assert "\n" not in message and "rmsnorm" in message and "learned" in message and "RMSNorm" in message
        assert not out.exists()
        return
    assert hf_weights.save_hf_model(ours, str(out)) == EXPECTED[norm, position]
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == EXPECTED[norm, position]
    for side in ("left", "right"):
        ids, mask = padded_batch(cfg.vocab_size, side)
        with torch.no_grad():
            theirs = hf(ids, attention_mask=mask, position_ids=positions(mask)).logits
            mine = ours(ids, attention_mask=mask)["logits"]
        real = mask.bool()
        assert (theirs - mine)[real].abs().max() <= 1e-4, side
    prompt = ids[2:3, :8]
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt, 32, CTX).tolist() == expected.tolist()

    back = hf_weights.load_hf_model(str(out))
    assert isinstance(back, GPTModel) and back.cfg == cfg
    assert same_weights(ours, back)  # bit for bit


def test_rotary_rows_must_be_permuted(tmp_path, monkeypatch):
    """The pairing convention matters: exported without moving the rows, GPT-NeoX computes another function."""
    ours = randomised(GPTModel(tiny("layernorm", "rope")))
    monkeypatch.setattr(hf_weights, "rope_to_halves", lambda d: torch.arange(d))
    hf_weights.save_hf_model(ours, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = padded_batch(300, "right")[0][2:]
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)["logits"]).abs().max() > 1e-2


def test_order_of_rotary_rows():
    assert hf_weights.rope_to_halves(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    w = torch.arange(16.0)[:, None]  # two heads of d_h = 8: rows 0..7, 8..15
    moved = hf_weights.permute_heads(w, 2, hf_weights.rope_to_halves(8))
    assert moved[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


@pytest.mark.parametrize("arch", ["gpt_neox", "arcee"])
def test_models_built_by_transformers_import(tmp_path, arch):
    """A GPT-NeoX or Arcee that transformers made (random weights, its own save_pretrained) loads and matches."""
    from transformers import AutoConfig

    settings = dict(vocab_size=300, hidden_size=EMB, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    intermediate_size=4 * EMB, hidden_act="gelu_pytorch_tanh", max_position_embeddings=CTX,
                    attention_bias=True, tie_word_embeddings=False)
    if arch == "gpt_neox":
        settings |= dict(use_parallel_residual=False, rotary_pct=1.0, layer_norm_eps=1e-6)
    else:
        settings |= dict(mlp_bias=True, rms_norm_eps=1e-6, num_key_value_heads=HEADS)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **settings))
    randomised(hf, seed=4)
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = hf_weights.load_hf_model(str(tmp_path / "hf"), want="gpt")
    assert ours.cfg.layer_norm_eps == 1e-6 and ours.cfg.qkv_bias and not ours.cfg.tie_embeddings
    ids, mask = padded_batch(300, "left")
    with torch.no_grad():
        diff = hf(ids, attention_mask=mask, position_ids=positions(mask)).logits - ours(ids, mask)["logits"]
    assert diff[mask.bool()].abs().max() <= 1e-4


@pytest.mark.parametrize("override, words", [
    ({"use_parallel_residual": True}, "use_parallel_residual is true"),
    ({"rotary_pct": 0.25}, "fraction 0.25"),
    ({"rotary_emb_base": 500.0}, "base 500"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"attention_bias": False}, "attention_bias"),
])
def test_neox_variants_our_model_cannot_compute_are_refused(tmp_path, override, words):
    settings = dict(vocab_size=300, hidden_size=EMB, num_hidden_layers=1, num_attention_heads=HEADS,
                    intermediate_size=4 * EMB, hidden_act="gelu_pytorch_tanh", max_position_embeddings=CTX,
                    use_parallel_residual=False, rotary_pct=1.0)
    GPTNeoXForCausalLM(GPTNeoXConfig(**{**settings, **override})).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(UserError, match="config.json") as e:
        hf_weights.load_hf_model(str(tmp_path / "hf"))
    assert words in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------------------
# reward models

TEXTS = [("", "房间很干净，服务也好。"), ("这家酒店怎么样？", "太吵了"),
         ("评价一下", "位置不错，早餐种类很多，下次还来。“值得”"), ("", "差"), ("好不好[ANS]", "好[SEP]不好")]
# special tokens' names typed as text: our encode reads them as characters, and so must an exported tokenizer
TYPED = ["你好[SEP]世界", "[CLS]开头", "[PAD][PAD]", "不认识的字是[UNK]", "[MASK]遮住", "问[ANS]答", "[sep] [Sep]"]


def conversations(pairs):
    return [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in pairs]


@pytest.mark.parametrize("norm, position", list(EXPECTED), ids=[f"{n}-{p}" for n, p in EXPECTED])
def test_reward_model_exports_as_sequence_classification(tmp_path, tokenizer, norm, position):
    cfg = tiny(norm, position, vocab_size=21128)
    rm = randomised(RewardModel(cfg), seed=5)
    with torch.no_grad():  # transformers' score has no bias: LayerNorm models fold it into the final shift
        rm.head.linear.bias.fill_(0.7 if norm == "layernorm" else 0.0)
    out = tmp_path / "rm-hf"
    written = hf_weights.save_hf_model(rm, str(out), tokenizer)
    assert written.endswith("ForSequenceClassification")
    hf = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(out))
    expected = score_texts(rm, tokenizer, [p for p, _ in TEXTS], [r for _, r in TEXTS])
    for side in ("left", "right"):
        hf_tokenizer.padding_side = side  # the documented path: the chat template over (user, assistant) turns
        batch = hf_tokenizer.apply_chat_template(conversations(TEXTS), padding=True, return_tensors="pt")
        assert bool((batch["attention_mask"] == 0).any())  # the lengths differ: the batch is padded
        extra = {"position_ids": positions(batch["attention_mask"])} if position == "learned" else {}
        with torch.no_grad():
            scores = hf(batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits[:, 0]
        assert max(abs(a - b) for a, b in zip(scores.tolist(), expected)) <= 1e-4, side
    assert "token_type_ids" not in hf_tokenizer("好")  # what the models take, no more
    # the tokenizer carries the chat template: one user turn and the response read as the RM reads them
    messages = [{"role": "user", "content": TEXTS[1][0]}]
    assert hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False) == \
        chat_messages_ids([("user", TEXTS[1][0])], tokenizer)

    back = hf_weights.load_hf_model(str(out), want="reward")
    assert isinstance(back, RewardModel) and back.cfg == cfg and same_weights(rm, back)  # the fold undone exactly
    with pytest.raises(UserError, match="is a reward model"):
        hf_weights.load_hf_model(str(out), want="gpt")


@pytest.mark.parametrize("bos_id", [None, 101], ids=["our-documents", "uer-documents"])
def test_the_exported_tokenizer_encodes_and_decodes_as_ours(tmp_path, tokenizer, bos_id):
    """``AutoTokenizer`` on an export: ``tokenizer(text)`` gives ``encode(text)`` (after [CLS] for a model whose
    documents started with it, as generate.py prompts it) with special tokens' names typed in the text read as
    text; ``apply_chat_template`` gives ``chat_messages_ids`` / ``chat_conversation_ids``; ``decode`` gives our
    text, no spaces between characters; and ``load_tokenizer`` reads the export back as the project tokenizer."""
    from chinese_tokenizer import (
        chat_conversation_ids,
        decode,
        encode,
        load_tokenizer,
        tokenizer_fingerprint,
    )

    model = GPTModel(tiny("layernorm", "learned", vocab_size=21128, bos_id=bos_id))
    hf_weights.save_hf_model(model, str(tmp_path / "hf"), tokenizer, chat=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    start = [] if bos_id is None else [bos_id]
    for text in TYPED + ["中国人民", "Hello, world!\n“引号”…\t　全角空格"]:
        ids = encode(text, tokenizer)
        assert hf_tokenizer(text)["input_ids"] == start + ids, text
        assert hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], return_dict=False) == \
            chat_messages_ids([("user", text)], tokenizer), text
        assert hf_tokenizer.apply_chat_template(conversations([(text, text)])[0], return_dict=False) == \
            chat_conversation_ids([("user", text), ("assistant", text)], tokenizer)[0], text
        assert hf_tokenizer.decode(ids) == decode(ids, tokenizer), text
    answer = [101] + encode("中国人民[UNK]", tokenizer) + [100, 5, 102, 0]  # [UNK] stays visible, control ids go
    assert hf_tokenizer.decode(answer, skip_special_tokens=True) == decode(answer, tokenizer) == "中国人民[unk][UNK]"
    back = load_tokenizer(str(tmp_path / "hf"))
    assert tokenizer_fingerprint(back) == tokenizer_fingerprint(tokenizer) and back.chat_template == CHAT_TEMPLATE


@pytest.mark.slow
@pytest.mark.parametrize("position, bos_id", [("rope", None), ("learned", 101)], ids=["ours", "uer-like"])
def test_text_generation_pipeline_continues_as_generate_py(tmp_path, tokenizer, position, bos_id):
    """``pipeline("text-generation", model=export)`` of a pretrain checkpoint returns, greedily, the prompt followed
    by exactly the text ``generate.py --temperature 0`` writes for the checkpoint: no [SEP] ends the prompt, no
    spaces come between characters."""
    import json

    from transformers import pipeline

    model = randomised(GPTModel(tiny("layernorm", position, vocab_size=21128, bos_id=bos_id)), seed=8)
    save_checkpoint(str(tmp_path / "pretrain"), model, tokenizer, {"stage": "pretrain", "step": 1})
    hf_weights.save_hf_model(model, str(tmp_path / "hf"), tokenizer)
    prompts = ["中国人民", "今天天气[SEP]很好"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    done = run("generate.py", "--checkpoint", tmp_path / "pretrain", "--prompts_file", tmp_path / "prompts.jsonl",
               "--output", tmp_path / "answers.jsonl", "--temperature", 0, "--max_new_tokens", 24, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line)["response"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    generator = pipeline("text-generation", model=str(tmp_path / "hf"))
    for prompt, answer in zip(prompts, answers):
        assert sum("\u4e00" <= ch <= "\u9fff" for ch in answer) >= 5, answer  # enough characters to see a space
        assert generator(prompt, max_new_tokens=24, do_sample=False)[0]["generated_text"] == prompt + answer


def test_reward_bias_without_a_place_is_refused(tmp_path):
    rm = randomised(RewardModel(tiny("rmsnorm", "rope")))
    with torch.no_grad():
        rm.head.linear.bias.fill_(0.3)
    with pytest.raises(UserError, match="RMSNorm model has no shift"):
        hf_weights.save_hf_model(rm, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------------------------------------------
# the commands


def run(script, *args, cwd):
    return subprocess.run([sys.executable, str(REPO_ROOT / script), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.slow
def test_cli_exports_chat_models_and_reward_models_and_imports_them(tmp_path, tokenizer):
    """load_weight.py --to_hf on an SFT-stage (chat) checkpoint and on a reward checkpoint, back with --from_hf;
    generate.py --from_hf answers the export through the chat template, as it answers the checkpoint."""
    policy = randomised(GPTModel(tiny("layernorm", "rope", vocab_size=21128)), seed=6)
    save_checkpoint(str(tmp_path / "sft"), policy, tokenizer, {"stage": "sft", "step": 1})
    rm = randomised(RewardModel(tiny("layernorm", "rope", vocab_size=21128)), seed=7)
    save_checkpoint(str(tmp_path / "rm"), rm, tokenizer, {"stage": "rm", "step": 1})

    done = run("load_weight.py", "--checkpoint", tmp_path / "sft", "--to_hf", tmp_path / "sft-hf", cwd=tmp_path)
    assert done.returncode == 0 and "GPTNeoXForCausalLM" in done.stdout and "chat template" in done.stdout, done.stderr
    assert load_tokenizer(str(tmp_path / "sft-hf")).chat_template == CHAT_TEMPLATE
    done = run("load_weight.py", "--checkpoint", tmp_path / "rm", "--to_hf", tmp_path / "rm-hf", cwd=tmp_path)
    assert done.returncode == 0 and "AutoModelForSequenceClassification" in done.stdout, done.stderr

    done = run("load_weight.py", "--from_hf", tmp_path / "rm-hf", "--to_checkpoint", tmp_path / "rm-back",
               cwd=tmp_path)
    assert done.returncode == 0 and "reward model" in done.stdout, done.stderr
    back, _, config = load_checkpoint(str(tmp_path / "rm-back"), "reward")
    assert config["stage"] == "hf-import" and same_weights(rm, back)

    # a chat export imported back stays a chat model, and exports again with its template
    done = run("load_weight.py", "--from_hf", tmp_path / "sft-hf", "--to_checkpoint", tmp_path / "sft-back",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert load_checkpoint(str(tmp_path / "sft-back"))[2]["stage"] == "hf-import-chat"
    done = run("load_weight.py", "--checkpoint", tmp_path / "sft-back", "--to_hf", tmp_path / "sft-hf2", cwd=tmp_path)
    assert done.returncode == 0 and "chat template" in done.stdout, done.stderr

    answers = [run("generate.py", flag, path, "--prompt", "你好", "--temperature", 0, "--max_new_tokens", 6,
                   cwd=tmp_path) for flag, path in (("--checkpoint", tmp_path / "sft"),
                                                   ("--from_hf", tmp_path / "sft-hf"),
                                                   ("--checkpoint", tmp_path / "sft-back"),
                                                   ("--from_hf", tmp_path / "sft-hf2"))]
    assert all(a.returncode == 0 and "chat template" in a.stderr for a in answers), [a.stderr for a in answers]
    assert len({a.stdout for a in answers}) == 1

    # a Hugging Face directory where a checkpoint is expected: the error says which flag reads it
    done = run("generate.py", "--checkpoint", tmp_path / "sft-hf", "--prompt", "你好", cwd=tmp_path)
    assert done.returncode == 2 and "is a Hugging Face directory" in done.stderr and "--from_hf" in done.stderr

    # pretraining starts from the GPT-NeoX export too (a rate so small that one step leaves the weights in place)
    text = "中国是世界上历史最悠久的国家之一。人民日报发表社论，回顾一年来的经济建设成就。\n\n" * 8
    (tmp_path / "train.txt").write_text(text, encoding="utf-8")
    done = run("0-PRETRAIN.py", "--init_from_hf", tmp_path / "sft-hf", "--preset", "tiny", "--max_steps", 1,
               "--learning_rate", 1e-9, "--batch_size", 2, "--eval_examples", 2, "--context_length", CTX,
               "--train_files", tmp_path / "train.txt", "--val_files", tmp_path / "train.txt",
               "--output_dir", tmp_path / "pretrain", "--tokenizer", REPO_ROOT / "data" / "tokenizer", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    continued, _, _ = load_checkpoint(str(tmp_path / "pretrain"))
    assert continued.cfg.position_embedding == "rope" and continued.cfg.bos_id is None
    ids = padded_batch(21128, "right")[0]
    with torch.no_grad():
        torch.testing.assert_close(continued(ids)["logits"], policy(ids)["logits"], atol=1e-4, rtol=1e-4)
