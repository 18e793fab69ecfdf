"""Our models in llama.cpp: ``load_weight.py --to_gguf`` (``plumbing/gguf_export.py``), proven by llama.cpp itself.

``llama-cpp-python`` (llama.cpp built from source) loads each exported file; every expected value comes from our
own model and tokenizer:

* logits on fixed ids: f32 within 1e-3 of ours. llama.cpp's CPU GELU reads a table of fp16 values (ggml-cpu's
  ``GGML_GELU_FP16``), so for weights drawn large, as here, the comparison is with our model whose GELU rounds its
  input and output through fp16 the same way; a trained model is compared with our model as it is;
* q8_0: the same top-1 token at >= 99% of the positions of the held-out text;
* our tokenizer's ids for a few hundred texts (typed special names, digits, Latin letters, full-width punctuation,
  the characters of the reserved slots);
* a chat model's greedy answer: the same tokens as ``generate.py --temperature 0``, and the same text through
  ``gguf_export.llama_text`` (llama.cpp's own detokenizer puts a space before every Chinese character);
* the chat template stored in the file renders, in llama-cpp-python's chat formatter, to our chat prompt's ids.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import load_weight
from chinese_tokenizer import ANSWER_ID, CHAT_TEMPLATE, EOS_ID, chat_messages_ids, encode
from conftest import POEMS
from gpt_model import GPTConfig, GPTModel, RewardModel, generate
from lora import add_lora, merge_lora
from plumbing.checkpoint import load_checkpoint, save_checkpoint
from plumbing.cli import UserError, run
from plumbing.gguf_export import (
    GGUF_CHAT_TEMPLATE,
    GgmlGELU,
    gguf_vocab,
    llama_text,
    modelfile,
    modelfile_path,
    save_gguf,
)

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is in requirements.txt; `make venv` builds it")

REPO_ROOT = Path(__file__).resolve().parent.parent
# shapes (learned positions -> llama.cpp gpt2; rope -> gptneox), tied or untied head, with or without q/k/v biases
VARIANTS = [("learned", True, False), ("learned", False, True), ("rope", True, False), ("rope", False, True)]
HELD_OUT = "红豆生南国，春来发几枝。愿君多采撷，此物最相思。" + POEMS

pytestmark = pytest.mark.usefixtures("quiet_single_thread")  # conftest.py


def config(position, tie, qkv_bias, context_length=128):
    return GPTConfig(context_length=context_length, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                     position_embedding=position, tie_embeddings=tie, qkv_bias=qkv_bias)


def randomised(model, seed=0):
    """Every parameter random and large enough that the logits spread over a few units, so a wrong mapping
    shows in every logit (larger weights make ggml's fp16 GELU table flip roundings that our copy of it does
    not, from float32 differences of 1e-7)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("scale") else p.normal_(0.0, 0.1)
    return model.eval()


def llama(path, n_ctx=256):
    """A llama.cpp context over ``path`` with every position's logits kept and an f32 KV cache (its default f16
    cache would round keys and values)."""
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=1, logits_all=True,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)


def llama_logits(path, ids):
    llm = llama(path)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)])  # (T, V)
    finally:
        llm.close()


def our_logits(model, ids, ggml_gelu=False):
    """Our model's logits (T, V) for ``ids``; with ``ggml_gelu`` those of a copy whose GELU is ggml's table."""
    if ggml_gelu:
        model = copy.deepcopy(model)
        for block in model.trf_blocks:
            block.ff.layers[1] = GgmlGELU()
    with torch.no_grad():
        return model(torch.tensor([ids]))["logits"][0].numpy()  # (T, V)


# --------------------------------------------------------------------------------------------------------------
# weights and logits


@pytest.mark.parametrize("position,tie,qkv_bias", VARIANTS)
def test_f32_logits_equal_ours_with_ggmls_gelu(tmp_path, tokenizer, position, tie, qkv_bias):
    model = randomised(GPTModel(config(position, tie, qkv_bias)))
    path = tmp_path / "m.gguf"
    assert save_gguf(model, str(path), tokenizer) == {"learned": "gpt2", "rope": "gptneox"}[position]
    ids = torch.randint(0, 21128, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    theirs, ours = llama_logits(path, ids), our_logits(model, ids, ggml_gelu=True)
    assert np.abs(ours).max() > 2  # spread logits: a wrong mapping could not hide
    assert np.abs(theirs - ours).max() <= 1e-3


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_f32_logits_of_a_trained_model_equal_ours(tmp_path, tokenizer, fitted_models, position):
    model = fitted_models[position]
    save_gguf(model, str(tmp_path / "m.gguf"), tokenizer)
    ids = encode(HELD_OUT, tokenizer)
    theirs, ours = llama_logits(tmp_path / "m.gguf", ids), our_logits(model, ids)
    # our exact GELU: the difference is ggml's fp16 GELU table (1.1e-3 and 1.4e-3 here, 1.24e-3 for the demo)
    assert 2e-4 < np.abs(theirs - ours).max() <= 2e-3
    assert np.abs(theirs - our_logits(model, ids, ggml_gelu=True)).max() <= 1e-3


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_q8_0_keeps_the_top_token(tmp_path, tokenizer, fitted_models, position):
    model = fitted_models[position]
    save_gguf(model, str(tmp_path / "q.gguf"), tokenizer, "q8_0")
    save_gguf(model, str(tmp_path / "f.gguf"), tokenizer, "f32")
    # the f16 head (21128 x 32) is most of so small a model: the demo's q8_0 file is 36% of its f32 one
    assert (tmp_path / "q.gguf").stat().st_size < 0.8 * (tmp_path / "f.gguf").stat().st_size
    ids = encode(HELD_OUT, tokenizer)
    theirs, ours = llama_logits(tmp_path / "q.gguf", ids), our_logits(model, ids)
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.99
    assert np.abs(theirs - ours).max() > 1e-3  # it is quantised: not the f32 file again


def test_f16_is_half_the_size_and_close(tmp_path, tokenizer, fitted_models):
    model = fitted_models["rope"]
    save_gguf(model, str(tmp_path / "h.gguf"), tokenizer, "f16")
    save_gguf(model, str(tmp_path / "f.gguf"), tokenizer, "f32")
    assert (tmp_path / "h.gguf").stat().st_size < 0.6 * (tmp_path / "f.gguf").stat().st_size
    ids = encode(HELD_OUT, tokenizer)
    assert np.abs(llama_logits(tmp_path / "h.gguf", ids) - our_logits(model, ids)).max() <= 5e-2


# --------------------------------------------------------------------------------------------------------------
# the tokenizer

SENTENCES = [
    "今天天气很好，我们去公园散步吧！", "这家餐厅的菜太咸了，服务也一般。", "他说：“明天见。”她回答：‘好的’……",
    "2024年12月7日，气温-3℃到5℃。", "iPhone 15 Pro Max 的价格是 9999 元。", "Hello, World! 你好，世界！",
    "ＡＢＣ１２３全角字母和数字", "（括号）【方括号】《书名号》、顿号；分号：冒号？问号！",
    "价格：$12.50 / €9.99 / ¥68", "第一行\n第二行\n\n第三行", "制表符\t之后", "全角空格\u3000之后", "破折号——之后",
    "省略号…之后",
    "[SEP] 是分隔符，[CLS] 是开头，[PAD] 填充，[MASK] 遮盖，[ANS] 回答，[UNK] 未知，[unused12] 保留。",
    "在文本里打出的 [SEP] 只是文字", "email: someone@example.com, url: https://example.com/a?b=1&c=2",
    "数学：3.14159 × 2 = 6.28318，1/3 ≈ 0.333", "Python 的 print() 函数和 C++ 的 std::cout", "ÀÉÎÕÜ café naïve",
    "《红楼梦》是中国古典四大名著之一。", "ＣＯＶＩＤ－１９疫情", "好好学习，天天向上。", "😀 表情符号和 ☆ 星号",
    "一二三四五六七八九十百千万亿", "abc def ghi", "超长的数字 123456789012345678901234567890",
    "Ｈｅｌｌｏ\u3000Ｗｏｒｌｄ", "“引号”里的‘单引号’", "温度：25°C，湿度：60%", "A股、B股和H股",
    "GPT-2 模型有 1.5B 参数", "韩文 한국어 和日文 ひらがな",
]


def texts():
    """A few hundred texts: each sentence alone, pairs of them joined with a space or a newline, and cut at three
    places (so pieces start and end inside words, numbers and runs of punctuation)."""
    out = list(SENTENCES)
    for i, a in enumerate(SENTENCES):
        b = SENTENCES[(i * 7 + 3) % len(SENTENCES)]
        out += [a + " " + b, a + "\n" + b, a + b]
        out += [a[k:] + b[:k] for k in (1, 3, 5)]
    return out


def hangul_as_llama_cpp_reads_it(text):
    """llama.cpp's normaliser maps each code point to the first code point of its NFD decomposition alone
    (``unicode_cpts_normalize_nfd``): right for an accented letter, whose accent BERT strips anyway, but a Hangul
    syllable keeps only its leading consonant (our tokenizer reads all of its jamo)."""
    return "".join(chr(0x1100 + (ord(c) - 0xAC00) // 588) if 0xAC00 <= ord(c) <= 0xD7A3 else c for c in text)


def test_llama_cpp_tokenizes_our_texts_into_our_ids(tmp_path, tokenizer):
    model = GPTModel(config("learned", True, False))
    save_gguf(model, str(tmp_path / "m.gguf"), tokenizer)
    llm = llama(tmp_path / "m.gguf")
    try:
        cases = texts()
        assert len(cases) >= 200
        korean = [text for text in cases if hangul_as_llama_cpp_reads_it(text) != text]
        assert 0 < len(korean) < 20
        for text in cases:
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            # the one difference: Korean, read by llama.cpp as its leading consonants (see above)
            assert theirs == encode(hangul_as_llama_cpp_reads_it(text), tokenizer), text
            assert (theirs == encode(text, tokenizer)) == (text not in korean), text
        # and back: llama_text writes what decode writes (no spaces between Chinese characters)
        for text in cases:
            ids = encode(text, tokenizer)
            assert llama_text(llm, ids) == tokenizer.decode(ids), text
    finally:
        llm.close()


def test_vocabulary_marks_word_starts_and_keeps_the_reserved_characters(tokenizer):
    from gguf import TokenType

    tokens, types = gguf_vocab(tokenizer)
    assert len(tokens) == len(set(tokens)) == 21128  # one id per text, or llama.cpp would lose some
    by_id = dict(enumerate(zip(tokens, types)))
    assert by_id[101] == ("[CLS]", TokenType.CONTROL) and by_id[100] == ("[UNK]", TokenType.UNKNOWN)
    assert by_id[encode("我", tokenizer)[0]] == ("\u2581我", TokenType.NORMAL)
    assert by_id[encode(" ", tokenizer)[0]] == (" ", TokenType.USER_DEFINED)
    continuation = tokenizer.convert_tokens_to_ids("##ing")
    assert by_id[continuation] == ("ing", TokenType.NORMAL)


# --------------------------------------------------------------------------------------------------------------
# a chat checkpoint end to end: the command line, the chat template, greedy decoding


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tokenizer, fitted_models):
    """The rope model saved as an SFT checkpoint (a chat model, as the pipeline's aligned ones are)."""
    path = tmp_path_factory.mktemp("gguf") / "sft"
    save_checkpoint(str(path), fitted_models["rope"], tokenizer, {"stage": "sft"})
    return path


def run_load_weight(capsys, *args):
    """``load_weight.py args`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        run(load_weight.main, [str(a) for a in args])
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def llama_greedy(llm, ids, max_new_tokens):
    """llama.cpp's greedy continuation of ``ids``: the argmax of its logits, until [SEP]."""
    llm.eval(ids)
    out = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token == EOS_ID:
            break
        out.append(token)
        llm.eval([token])
    return out


@pytest.mark.slow
def test_chat_model_continues_greedily_as_generate_py(tmp_path, capsys, tokenizer, chat_checkpoint):
    code, out, err = run_load_weight(capsys, "--checkpoint", chat_checkpoint, "--to_gguf", tmp_path / "chat.gguf")
    assert code == 0, err
    assert "gptneox" in out and (tmp_path / "chat.Modelfile").is_file()
    prompts = ["床前明月光，", "春眠不觉晓，", "白日依山尽，"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    ours = subprocess.run([sys.executable, "generate.py", "--checkpoint", str(chat_checkpoint), "--prompts_file",
                           str(tmp_path / "prompts.txt"), "--temperature", "0", "--max_new_tokens", "24", "--output",
                           str(tmp_path / "answers.jsonl")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert ours.returncode == 0, ours.stderr
    answers = [json.loads(line)["response"] for line in (tmp_path / "answers.jsonl").read_text("utf-8").splitlines()]
    our_model, _, _ = load_checkpoint(str(chat_checkpoint))
    llm = llama(tmp_path / "chat.gguf")
    try:
        assert llm.metadata["tokenizer.chat_template"] == GGUF_CHAT_TEMPLATE
        for prompt, text in zip(prompts, answers, strict=True):
            prompt_ids = chat_messages_ids([("user", prompt)], tokenizer)
            llm.reset()
            answer = llama_greedy(llm, prompt_ids, 24)
            assert answer, "an empty answer proves nothing"
            assert llama_text(llm, answer) == text
            greedy = generate(our_model, torch.tensor([prompt_ids]), 24, 128, temperature=0.0, eos_id=EOS_ID)
            assert answer == [t for t in greedy[0, len(prompt_ids):].tolist() if t != EOS_ID]
    finally:
        llm.close()


MESSAGES = [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "你好"},
            {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "写一条好评："}]


def test_a_chat_prompt_is_ours_in_llama_cpp_python_and_in_llama_cpps_programs(tmp_path, tokenizer, fitted_models):
    """Both ways a chat prompt reaches llama.cpp's tokenizer give ``chat_messages_ids``: llama-cpp-python's chat
    formatter renders the stored template and adds no special tokens; llama.cpp's programs render it with
    ``enable_thinking`` set (common/chat.cpp), take the bos text off when the file says they add bos, and tokenize
    with the special tokens added, which a WordPiece vocabulary wraps as bos ... sep."""
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    save_gguf(fitted_models["rope"], str(tmp_path / "c.gguf"), tokenizer, chat=True)
    ours = chat_messages_ids([(m["role"], m["content"]) for m in MESSAGES], tokenizer)
    llm = llama(tmp_path / "c.gguf")
    try:
        meta = llm.metadata
        bos, eos = (llm.detokenize([int(meta[f"tokenizer.ggml.{k}_token_id"])], special=True).decode()
                    for k in ("bos", "eos"))
        formatter = Jinja2ChatFormatter(template=meta["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
        prompt = formatter(messages=MESSAGES).prompt
        assert llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) == ours
        rendered = jinja2.Template(meta["tokenizer.chat_template"]).render(
            messages=MESSAGES, bos_token=bos, eos_token=eos, enable_thinking=False, add_generation_prompt=True)
        if meta["tokenizer.ggml.add_bos_token"] == "true" and rendered.startswith(bos):
            rendered = rendered[len(bos):]
        if meta["tokenizer.ggml.add_eos_token"] == "true" and rendered.endswith(eos):
            rendered = rendered[:-len(eos)]
        assert llm.tokenize(rendered.encode("utf-8"), add_bos=True, special=True) == ours
        assert llm.token_eos() == EOS_ID and int(meta["tokenizer.ggml.seperator_token_id"]) == ANSWER_ID
        # and llama-cpp-python's own chat completion answers as our greedy decoding does
        answer = llm.create_chat_completion(messages=MESSAGES, temperature=0.0, max_tokens=12)
        greedy = generate(fitted_models["rope"], torch.tensor([ours]), 12, 128, temperature=0.0, eos_id=EOS_ID)
        expected = [t for t in greedy[0, len(ours):].tolist() if t != EOS_ID]
        assert expected and answer["choices"][0]["message"]["content"] == llm.detokenize(expected).decode()
    finally:
        llm.close()


@pytest.mark.parametrize("messages", [
    MESSAGES, MESSAGES[1:], [MESSAGES[0], {"role": "system", "content": "简短。"}, *MESSAGES[1:2]],
    [{"role": "user", "content": "写一条差评：[SEP]"}]])
def test_the_gguf_template_renders_ours_and_leaves_the_last_answer_mark_to_llama_cpps_programs(messages):
    import jinja2

    ours = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    theirs = jinja2.Template(GGUF_CHAT_TEMPLATE)
    assert theirs.render(messages=messages, add_generation_prompt=True) == ours
    assert theirs.render(messages=messages, enable_thinking=False, add_generation_prompt=True) + "[ANS]" == ours


def test_llama_cpps_programs_end_a_plain_prompt_with_sep(tmp_path, tokenizer, fitted_models):
    """A pretrained model's file: llama.cpp's programs wrap a prompt as [CLS] text [SEP] (WordPiece's rule, which
    no key of the file turns off), so text is continued as ours only from ids without them."""
    save_gguf(fitted_models["rope"], str(tmp_path / "p.gguf"), tokenizer)
    llm = llama(tmp_path / "p.gguf")
    try:
        ids = encode("床前明月光", tokenizer)
        assert llm.tokenize("床前明月光".encode(), add_bos=True, special=True) == [101, *ids, EOS_ID]
        assert llm.tokenize("床前明月光".encode(), add_bos=False, special=False) == ids
        assert llm.token_eos() == EOS_ID
    finally:
        llm.close()


def test_modelfile_names_the_file_the_template_and_the_stop_token():
    chat = modelfile("out/ppo.gguf", chat=True, context_length=256)
    assert chat.startswith("# ollama create NAME -f ppo.Modelfile") and modelfile_path("out/ppo.gguf") == \
        "out/ppo.Modelfile"
    assert "FROM ./ppo.gguf" in chat and 'PARAMETER stop "[SEP]"' in chat and "PARAMETER num_ctx 256" in chat
    assert "[ANS]{{ end }}" in chat and "{{ if not $last }}" in chat and "{{ .Content }}" in chat
    assert "[CLS]" not in chat  # the tokenizer adds it, and the last [ANS], as in llama.cpp's programs
    assert 'TEMPLATE """{{ .Prompt }}"""' in modelfile("out/base.gguf", chat=False, context_length=256)


# --------------------------------------------------------------------------------------------------------------
# what cannot go to llama.cpp, and the command line


def test_rmsnorm_and_reward_models_are_refused_before_writing(tmp_path, tokenizer):
    rms = GPTModel(GPTConfig(context_length=64, emb_dim=32, n_heads=4, n_layers=1, norm="rmsnorm",
                             position_embedding="rope"))
    with pytest.raises(UserError, match="no architecture for an RMSNorm model.*--to_hf"):
        save_gguf(rms, str(tmp_path / "r.gguf"), tokenizer)
    with pytest.raises(UserError, match="reward model has no llama.cpp counterpart.*--to_hf"):
        save_gguf(RewardModel(config("learned", True, False)), str(tmp_path / "rm.gguf"), tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_in_one_line_and_keeps_what_exists(tmp_path, capsys, tokenizer, chat_checkpoint):
    rms = tmp_path / "rms"
    save_checkpoint(str(rms), GPTModel(config("rope", True, False).replace(norm="rmsnorm")), tokenizer,
                    {"stage": "sft"})
    target = tmp_path / "m.gguf"
    target.write_bytes(b"keep me")
    (tmp_path / "d.gguf").mkdir()
    for args, words in [
        (("--checkpoint", rms, "--to_gguf", tmp_path / "x.gguf"), "llama.cpp has no architecture for an RMSNorm"),
        (("--checkpoint", chat_checkpoint, "--to_gguf", target), "already exists; pass --overwrite"),
        (("--checkpoint", chat_checkpoint, "--to_gguf", tmp_path / "x.gguf", "--peft"), "drop --peft"),
        (("--checkpoint", chat_checkpoint, "--to_gguf", tmp_path / "x.gguf", "--to_hf", tmp_path / "h"),
         "different outputs"),
        (("--checkpoint", chat_checkpoint, "--to_hf", tmp_path / "h", "--gguf_type", "q8_0"), "goes with --to_gguf"),
        (("--checkpoint", chat_checkpoint, "--to_gguf", tmp_path / "d.gguf", "--overwrite"), "is a directory"),
        (("--checkpoint", chat_checkpoint, "--to_gguf", tmp_path / "x.Modelfile"), "name the file NAME.gguf"),
        (("--checkpoint", chat_checkpoint, "--to_gguf", "/proc/x.gguf"), "could not write --to_gguf /proc/x.gguf"),
    ]:
        code, _, err = run_load_weight(capsys, *args)
        assert code == 2, (args, err)
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert target.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "m.gguf", "rms"]
    code, out, err = run_load_weight(capsys, "--checkpoint", chat_checkpoint, "--to_gguf", target, "--gguf_type",
                                     "q8_0", "--overwrite")
    assert code == 0, err
    assert target.read_bytes()[:4] == b"GGUF" and (tmp_path / "m.Modelfile").is_file()
    assert target.stat().st_mode & 0o044 == 0o044  # readable as the umask allows, not private to its writer


def test_a_lora_checkpoint_leaves_merged(tmp_path, capsys, tokenizer, fitted_models, chat_checkpoint):
    model, _, _ = load_checkpoint(str(chat_checkpoint))
    add_lora(model, rank=4, alpha=8, targets=["W_query", "W_value"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # a non-zero update, so "merged" differs from the base
    ids = encode(HELD_OUT, tokenizer)
    merged = copy.deepcopy(model).eval()
    merge_lora(merged)
    ours = our_logits(merged, ids, ggml_gelu=True)
    path = tmp_path / "lora"
    save_checkpoint(str(path), model, tokenizer, {"stage": "sft", "parent": str(chat_checkpoint)})
    code, _, err = run_load_weight(capsys, "--checkpoint", path, "--to_gguf", tmp_path / "l.gguf")
    assert code == 0, err
    theirs = llama_logits(tmp_path / "l.gguf", ids)
    assert np.abs(theirs - ours).max() <= 1e-3
    assert np.abs(theirs - our_logits(fitted_models["rope"], ids)).max() > 1e-2  # the adapters are in
