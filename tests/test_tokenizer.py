"""Tests of chinese_tokenizer.py (and the text helpers of gpt_model.py).

Expected ids are read straight from bert-base-chinese's ``vocab.txt`` (line number = id), not from the tokenizer
under test; round trips compare with the original text.
"""

import re
import string
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chinese_tokenizer as ct
import gpt_model as gm

VOCAB_FILE = Path(__file__).resolve().parent.parent / "data" / "tokenizer" / "vocab.txt"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def vocab_lines(tokenizer):
    """The raw vocabulary: line i of vocab.txt is the token of id i (the tokenizer fixture makes sure it exists)."""
    lines = VOCAB_FILE.read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


@pytest.fixture(scope="module")
def vid(vocab_lines):
    """token -> id, from vocab.txt."""
    index = {tok: i for i, tok in enumerate(vocab_lines)}
    return lambda chars: [index[c] for c in chars]


def alphabet_from_vocab():
    """Characters that are each one vocab token and that BERT's normaliser leaves alone."""
    tokens = set(VOCAB_FILE.read_text(encoding="utf-8").split("\n"))
    cjk = sorted(t for t in tokens if len(t) == 1 and 0x4E00 <= ord(t) <= 0x9FFF)
    punct = [c for c in string.punctuation + "，。！？；：、（）《》【】「」『』·～％￥" if c in tokens]
    return cjk, punct


# --------------------------------------------------------------------------------------------------------------
# vocabulary and special ids


def test_vocab_size_and_special_ids(tokenizer, vocab_lines):
    """21128 ids; [PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103 as in bert-base-chinese's vocab.txt."""
    assert len(vocab_lines) == 21128
    assert len(tokenizer) == 21128 == ct.VOCAB_SIZE
    for name, i in [("[PAD]", 0), ("[UNK]", 100), ("[CLS]", 101), ("[SEP]", 102), ("[MASK]", 103)]:
        assert vocab_lines[i] == name
        assert tokenizer.convert_tokens_to_ids(name) == i
    assert (ct.PAD_ID, ct.UNK_ID, ct.CLS_ID, ct.SEP_ID, ct.EOS_ID) == (0, 100, 101, 102, 102)
    assert tokenizer.pad_token_id == 0 and tokenizer.cls_token_id == 101 and tokenizer.sep_token_id == 102


SLOT_CHARS = {"\n": 1, " ": 2, "\t": 3, "\u3000": 4, "\u201c": 6, "\u201d": 7, "\u2018": 8, "\u2019": 9,
              "\u2014": 10, "\u2026": 11}  # whitespace, then “ ” ‘ ’ — …


def test_whitespace_quotes_and_answer_use_reserved_slots(tokenizer, vocab_lines):
    """Whitespace, curly quotes, em dash, ellipsis and [ANS] take the ids of [unused1..11]: the vocabulary does
    not grow."""
    for ch, i in SLOT_CHARS.items():
        assert vocab_lines[i] == f"[unused{i}]"
        assert ct.encode(ch, tokenizer) == [i], repr(ch)
    assert vocab_lines[5] == "[unused5]" and ct.ANSWER_ID == 5
    assert tokenizer.convert_tokens_to_ids("[ANS]") == 5


def test_wrong_vocabulary_is_refused(tmp_path):
    """A vocab.txt that is not 21128 lines, or a directory without a tokenizer, raises TokenizerError."""
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n", encoding="utf-8")
    with pytest.raises(ct.TokenizerError, match="21128"):
        ct.load_tokenizer(str(tmp_path))
    with pytest.raises(ct.TokenizerError):
        ct.load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ct.TokenizerError):
        ct.build_tokenizer(str(tmp_path / "missing.txt"))


def test_plain_vocab_and_saved_dir_agree(tokenizer, tmp_path):
    """A directory holding only vocab.txt builds a tokenizer that encodes like the saved one."""
    (tmp_path / "vocab.txt").write_bytes(VOCAB_FILE.read_bytes())
    fresh = ct.load_tokenizer(str(tmp_path))
    for text in SAMPLES:
        assert ct.encode(text, fresh) == ct.encode(text, tokenizer)


# --------------------------------------------------------------------------------------------------------------
# encode / decode

SAMPLES = [
    "你好，世界！",
    "我爱北京天安门。\n第二行",
    "hello world",
    "gpt-2 在 2019 年发布，有 1.5b 参数。",
    "a  b   c",  # runs of spaces
    "\t缩进\t的行\n\n\n空行之后",
    "全角\u3000空格",
    "  前后都有空格  ",
    "价格：￥12.50（含税）；折扣 30%！",
    "email: test@example.com, path: /usr/bin/python3",
    "他说：“好的——就这样……”‘嗯’",  # curly quotes, em dash, ellipsis: reserved slots
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tokenizer, text):
    """Mixed Chinese, lower-case English, digits, punctuation, newlines, space runs, tabs and U+3000 come back."""
    assert ct.decode(ct.encode(text, tokenizer), tokenizer) == text


def test_encode_uses_vocab_ids_and_adds_no_specials(tokenizer, vid):
    """Each CJK character is its vocab.txt line; no [CLS]/[SEP] unless asked for."""
    assert ct.encode("我爱你", tokenizer) == vid("我爱你")
    assert ct.encode("我爱你", tokenizer, add_special_tokens=True) == [101] + vid("我爱你") + [102]
    assert ct.encode("", tokenizer) == []


def test_decode_puts_no_space_between_cjk(tokenizer, vid):
    """Ids looked up in vocab.txt decode to the characters glued together; Latin words keep their spaces."""
    assert ct.decode(vid("今天天气很好"), tokenizer) == "今天天气很好"
    assert ct.decode(vid("我") + [2] + vid("你"), tokenizer) == "我 你"  # an explicit space token stays
    assert ct.decode(ct.encode("good morning 中国", tokenizer), tokenizer) == "good morning 中国"


def test_decode_drops_special_tokens_but_shows_unk(tokenizer, vid):
    """[CLS], [SEP], [PAD], [ANS], [MASK] vanish on decode (unless asked); [UNK] stays visible."""
    ids = [101] + vid("你") + [5, 103, 0] + vid("好") + [102, 100]
    assert ct.decode(ids, tokenizer) == "你好[UNK]"
    kept = ct.decode(ids, tokenizer, skip_special_tokens=False)
    assert "[CLS]" in kept and "[SEP]" in kept and "你" in kept
    assert ct.decode(torch.tensor(vid("你好")), tokenizer) == "你好"  # a tensor works too


def test_upper_case_and_out_of_vocab(tokenizer, vocab_lines):
    """Documented losses: upper case is lowered; characters missing from the vocabulary become [UNK]."""
    assert ct.decode(ct.encode("Hello GPT", tokenizer), tokenizer) == "hello gpt"
    rare = "\U00020000"  # CJK extension B, absent from bert-base-chinese
    assert rare not in vocab_lines
    assert ct.encode(f"好{rare}", tokenizer) == [vocab_lines.index("好"), 100]


def test_line_endings_are_normalised(tokenizer):
    """CRLF and lone CR encode as a newline."""
    assert ct.encode("a\r\nb\rc", tokenizer) == ct.encode("a\nb\nc", tokenizer)
    assert ct.normalize_text("x\r\ny\rz") == "x\ny\nz"


def test_word_longer_than_100_characters_round_trips(tokenizer):
    """A 101-character run of letters or digits (a long number, a hash) must survive the round trip."""
    for text in ("a" * 101, "1" * 120, "x" + "0123456789" * 12):
        assert ct.decode(ct.encode(text, tokenizer), tokenizer) == text


def test_saved_directory_loads_with_autotokenizer(tokenizer, tmp_path):
    """save_pretrained -> transformers.AutoTokenizer.from_pretrained gives 21128 ids and the same encodings."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(tmp_path))
    for directory in (tmp_path, VOCAB_FILE.parent):
        auto = AutoTokenizer.from_pretrained(str(directory))
        assert len(auto) == 21128
        for text in SAMPLES:
            norm = ct.normalize_text(text)
            assert auto.encode(norm, add_special_tokens=False) == ct.encode(text, tokenizer), (directory, text)
        assert auto.encode("你好", add_special_tokens=True)[0] == 101
    reloaded = ct.load_tokenizer(str(tmp_path))
    assert all(ct.decode(ct.encode(t, reloaded), reloaded) == t for t in SAMPLES)


# --------------------------------------------------------------------------------------------------------------
# text_to_token_ids / token_ids_to_text


def test_text_token_id_helpers(tokenizer, vid):
    """text_to_token_ids -> (1, T) long tensor of vocab ids; token_ids_to_text accepts (1, T) and (T,)."""
    ids = ct.text_to_token_ids("你好，世界", tokenizer)
    assert ids.shape == (1, 5) and ids.dtype == torch.long
    assert ids[0].tolist() == vid("你好，世界")
    assert ct.token_ids_to_text(ids, tokenizer) == "你好，世界"
    assert ct.token_ids_to_text(ids[0], tokenizer) == "你好，世界"


# --------------------------------------------------------------------------------------------------------------
# the chat template


def test_chat_template_layout(tokenizer, vid):
    """[CLS] prompt [ANS] response [SEP]; the mask covers the response and its [SEP]; the prompt half is a prefix."""
    ids, mask, truncated = ct.apply_chat_template("你好", "我很好", tokenizer)
    assert ids == [101] + vid("你好") + [5] + vid("我很好") + [102]
    assert mask == [0, 0, 0, 0, 1, 1, 1, 1]
    assert truncated is False
    assert ct.chat_prompt_ids("你好", tokenizer) == ids[:4]


def test_chat_template_cuts_the_prompt_from_the_left(tokenizer, vid):
    """Too long: the prompt loses its first tokens, the response and [SEP] stay whole, and the flag is set."""
    ids, mask, truncated = ct.apply_chat_template("一二三四五六七八九十", "好的", tokenizer, max_length=10)
    assert ids == [101] + vid("六七八九十") + [5] + vid("好的") + [102]
    assert mask == [0] * 7 + [1] * 3
    assert truncated is True
    exact = len([101] + vid("一二三四五六七八九十") + [5] + vid("好的") + [102])
    assert ct.apply_chat_template("一二三四五六七八九十", "好的", tokenizer, max_length=exact)[2] is False


def test_chat_template_response_alone_too_long(tokenizer, vid):
    """If even the response does not fit, one prompt token is kept and the response is cut from its right."""
    response = "天地玄黄宇宙洪荒日月盈昃辰宿列张"
    ids, mask, truncated = ct.apply_chat_template("问", response, tokenizer, max_length=10)
    assert ids == [101] + vid("问") + [5] + vid(response[:7])
    assert mask == [0, 0, 0] + [1] * 7
    assert truncated is True and 102 not in ids


@FUZZ
@given(prompt_len=st.integers(1, 30), response_len=st.integers(0, 30), max_length=st.integers(3, 70),
       seed=st.integers(0, 10**6))
def test_chat_template_properties(tokenizer, prompt_len, response_len, max_length, seed):
    """For any lengths (non-empty prompt): L <= max_length, a pair that fits is untouched, the prompt kept is a suffix,
    the response kept a prefix (with [SEP] when
    the response fits), a prompt token survives whenever there is one, and the flag says whether anything was cut."""
    import random

    cjk, _ = ALPHABET
    rnd = random.Random(seed)
    prompt = "".join(rnd.choice(cjk) for _ in range(prompt_len))
    response = "".join(rnd.choice(cjk) for _ in range(response_len))
    full_p, full_r = ct.encode(prompt, tokenizer), ct.encode(response, tokenizer) + [102]
    ids, mask, truncated = ct.apply_chat_template(prompt, response, tokenizer, max_length=max_length)
    assert len(ids) == len(mask) <= max_length
    n_resp = sum(mask)
    assert mask == [0] * (len(ids) - n_resp) + [1] * n_resp
    assert ids[0] == 101 and ids[len(ids) - n_resp - 1] == 5
    kept_p, kept_r = ids[1: len(ids) - n_resp - 1], ids[len(ids) - n_resp:]
    assert kept_p == full_p[len(full_p) - len(kept_p):]
    assert kept_r == full_r[: len(kept_r)]
    if len(full_r) <= max_length - 3:
        assert kept_r == full_r  # the closing [SEP] is never dropped while the response fits
    if len(full_p) + len(full_r) + 2 <= max_length:
        assert (kept_p, kept_r, truncated) == (full_p, full_r, False)
    if max_length >= 4:
        assert kept_p, "a prompt token survives"
    assert truncated == (kept_p != full_p or kept_r != full_r)


def test_chat_template_empty_prompt_that_fits_is_untouched(tokenizer, vid):
    """An empty prompt with a response that fits keeps the response whole, [SEP] included, with the flag off."""
    ids, mask, truncated = ct.apply_chat_template("", "好的", tokenizer, max_length=5)
    assert ids == [101, 5] + vid("好的") + [102]
    assert mask == [0, 0, 1, 1, 1] and truncated is False


def test_chat_template_tiny_max_length(tokenizer):
    """max_length below the 3 ids of the layout: either a ValueError or a result that respects the bound."""
    try:
        ids, _, _ = ct.apply_chat_template("你好", "好", tokenizer, max_length=2)
    except ValueError:
        return
    assert len(ids) <= 2


def test_chat_messages_of_one_turn_are_the_sft_layout(tokenizer):
    """One user turn and no system text: exactly chat_prompt_ids, with and without a length limit."""
    for prompt, limit in (("今天天气", None), ("今天天气", 4), ("一二三四五六七八九十", 6)):
        expected = ct.chat_prompt_ids(prompt, tokenizer, limit)
        assert ct.chat_messages_ids([("user", prompt)], tokenizer, limit) == expected


def test_chat_messages_layout_and_cuts(tokenizer, vid):
    """[CLS] system [SEP] user [ANS] assistant [SEP] user [ANS]; too long: the oldest pair goes first, then the
    system text, then the start of the last user turn (worked by hand in notes/chinese_tokenizer.md section 5)."""
    messages = [("system", "你是助手"), ("user", "你好"), ("assistant", "好"), ("user", "今天天气")]
    full = [101] + vid("你是助手") + [102] + vid("你好") + [5] + vid("好") + [102] + vid("今天天气") + [5]
    assert ct.chat_messages_ids(messages, tokenizer) == full
    assert ct.chat_messages_ids(messages, tokenizer, len(full)) == full
    assert ct.chat_messages_ids(messages, tokenizer, 11) == [101] + vid("你是助手") + [102] + vid("今天天气") + [5]
    assert ct.chat_messages_ids(messages, tokenizer, 7) == [101] + vid("今天天气") + [5]
    assert ct.chat_messages_ids(messages, tokenizer, 4) == [101] + vid("天气") + [5]
    two_systems = [("system", "甲"), ("system", "乙"), ("user", "问")]
    expected = [101] + vid("甲") + [1] + vid("乙") + [102] + vid("问") + [5]  # "\n" is [unused1]
    assert ct.chat_messages_ids(two_systems, tokenizer) == expected


@pytest.mark.parametrize("messages, words", [
    ([], "no user message"),
    ([("system", "x")], "no user message"),
    ([("user", "a"), ("user", "b")], "message 2 has role 'user' but 'assistant' is due"),
    ([("user", "a"), ("assistant", "b")], "ends with an assistant turn"),
    ([("assistant", "a"), ("user", "b")], "message 1 has role 'assistant'"),
    ([("user", "a"), ("assistant", "b"), ("system", "c"), ("user", "d")], "message 3 has role 'system'"),
    ([("tool", "a")], "use system, user or assistant"),
])
def test_chat_messages_refuse_bad_conversations(tokenizer, messages, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ct.chat_messages_ids(messages, tokenizer)


def test_incremental_decoder_gives_each_piece_once(tokenizer):
    """Pushing a text's ids one by one hands out the text exactly once, word pieces joined."""
    text = "你好，playing世界\n再见"
    ids = ct.encode(text, tokenizer)
    decoder = ct.IncrementalDecoder(tokenizer)
    assert "".join(decoder.push(i) for i in ids) == text == decoder.text


# --------------------------------------------------------------------------------------------------------------
# fuzzing

ALPHABET = alphabet_from_vocab() if VOCAB_FILE.is_file() else (["中"], ["，"])


def vocab_text():
    """Text from single-token characters: CJK, digits, lower-case words, punctuation, whitespace and the
    reserved-slot characters."""
    cjk, punct = ALPHABET
    piece = st.one_of(
        st.sampled_from(cjk),
        st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=12),
        st.sampled_from(punct),
        st.sampled_from(sorted(SLOT_CHARS)),
    )
    return st.lists(piece, max_size=40).map("".join)


@FUZZ
@given(text=st.text(max_size=80))
def test_any_unicode_encodes_and_decodes_without_error(tokenizer, text):
    """Arbitrary unicode never makes encode or decode raise; ids stay inside the vocabulary."""
    ids = ct.encode(text, tokenizer)
    assert all(0 <= i < 21128 for i in ids)
    assert isinstance(ct.decode(ids, tokenizer), str)


@FUZZ
@given(ids=st.lists(st.integers(0, 21127), max_size=60))
def test_any_ids_decode_without_error(tokenizer, ids):
    """Any id sequence decodes to a string (sampling can emit anything)."""
    assert isinstance(ct.decode(ids, tokenizer), str)


@FUZZ
@given(text=vocab_text())
def test_vocab_text_round_trips_exactly(tokenizer, text):
    """Text built from characters that are single vocab tokens (plus whitespace) comes back unchanged."""
    ids = ct.encode(text, tokenizer)
    assert 100 not in ids
    assert ct.decode(ids, tokenizer) == text


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return gm.GPTModel(gm.get_preset("tiny")).eval()


@FUZZ
@given(text=st.text(max_size=40))
def test_generate_runs_on_fuzzed_prompts(tokenizer, tiny_model, text):
    """Any text, put in the chat template, can be continued by generate and decoded."""
    prompt = torch.tensor([ct.chat_prompt_ids(text, tokenizer)])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = gm.generate(tiny_model, prompt, max_new_tokens=3, context_size=64, temperature=1.0, top_k=50)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (1, prompt.shape[1] + 3)
    assert torch.equal(out[:, : prompt.shape[1]], prompt)
    assert isinstance(ct.token_ids_to_text(out[0, prompt.shape[1]:], tokenizer), str)


def test_special_token_names_typed_in_text_are_plain_text(tokenizer):
    """A user typing "[CLS]" or "[ANS]" gets ordinary pieces, never the control ids 101 or 5."""
    ids = ct.encode("a[CLS]b[ANS]c[SEP]", tokenizer)
    assert not {ct.CLS_ID, ct.SEP_ID, ct.ANSWER_ID} & set(ids)
    assert ct.decode(ids, tokenizer) == "a[cls]b[ans]c[sep]"  # lower-cased like all Latin text
