"""Tests for supervised fine-tuning: the response-only labels and batches (plumbing/batching.py, records.py) and
1-SFT.py end to end."""

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chinese_tokenizer as ct
from gpt_model import GPTModel, generate, get_preset, next_token_loss
from plumbing.batching import ChatPairs, chat_example, collate_chat, length_grouped_batches
from plumbing.checkpoint import load_checkpoint
from plumbing.cli import run

REPO = Path(__file__).resolve().parent.parent
CLS, ANS, SEP, PAD = ct.CLS_ID, ct.ANSWER_ID, ct.SEP_ID, ct.PAD_ID


def load_script(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, REPO / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SFT = load_script("sft_stage", "1-SFT.py")


def char_ids(text, tokenizer):
    """Ids of a text of single-character vocab tokens, looked up one by one (independent of encode)."""
    return tokenizer.convert_tokens_to_ids(list(text))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def run_main(module, argv) -> int:
    """Run a stage's ``main`` through ``cli.run`` (as ``python X.py`` does) and return the exit code."""
    with pytest.raises(SystemExit) as exit_info:
        run(module.main, [str(a) for a in argv])
    return exit_info.value.code


def dir_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# --- labels, shift, padding, loss ------------------------------------------------------------------------------

def test_labels_are_shifted_exactly_once(tokenizer):
    """[CLS] 你 好 [ANS] 好 的 [SEP]: the model reads all but [SEP]; [ANS] predicts 好, the last 的 predicts [SEP]."""
    ni, hao, de = char_ids("你好的", tokenizer)
    ids, mask, truncated = ct.apply_chat_template("你好", "好的", tokenizer)
    assert ids == [CLS, ni, hao, ANS, hao, de, SEP] and not truncated
    inputs, labels = chat_example(ids, mask)
    assert inputs == [CLS, ni, hao, ANS, hao, de]
    assert labels == [-100, -100, -100, hao, de, SEP]


def test_collate_pads_on_the_right(tokenizer):
    short = ([CLS, 7, ANS, 8], [-100, -100, 8, SEP])
    long = ([CLS, 7, 9, 9, ANS, 8], [-100, -100, -100, -100, 8, SEP])
    batch = collate_chat([short, long])
    assert batch["input_ids"].tolist() == [[CLS, 7, ANS, 8, PAD, PAD], [CLS, 7, 9, 9, ANS, 8]]
    assert batch["labels"].tolist() == [[-100, -100, 8, SEP, -100, -100], [-100, -100, -100, -100, 8, SEP]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]


def test_loss_is_masked_cross_entropy_on_the_response_only(tokenizer):
    """next_token_loss on a collated batch == a hand loop over response positions; pad content and prompt-side
    targets do not matter, response targets do."""
    torch.manual_seed(0)
    model = GPTModel(get_preset("tiny")).eval()
    pairs = [("今天天气怎么样", "很好"), ("你好", "你好呀朋友")]
    templated = [ct.apply_chat_template(p, r, tokenizer) for p, r in pairs]
    batch = collate_chat([chat_example(ids, mask) for ids, mask, _ in templated])
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]  # (2, T, V)
    loss = next_token_loss(logits, batch["labels"])

    terms = []  # by hand: position t is scored on ids[t + 1] exactly when ids[t + 1] is a response token
    for row, (ids, mask, _) in enumerate(templated):
        for t in range(len(ids) - 1):
            if mask[t + 1]:
                terms.append(-torch.log_softmax(logits[row, t].double(), dim=-1)[ids[t + 1]])
    assert len(terms) == (2 + 1) + (5 + 1)  # response characters + [SEP] per row
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5)

    noisy = batch["input_ids"].clone()  # other tokens in the padding: same outputs at the real positions
    pad = batch["attention_mask"] == 0
    assert pad.any()
    noisy[pad] = torch.randint(200, 8000, (int(pad.sum()),))
    noisy_logits = model(noisy, attention_mask=batch["attention_mask"])["logits"]
    assert next_token_loss(noisy_logits, batch["labels"]).item() == pytest.approx(loss.item(), abs=1e-6)

    # another prompt of the same length: the very same labels, so the same loss for the same logits
    _, other_labels = chat_example(*ct.apply_chat_template("明天会不会下雨", "很好", tokenizer)[:2])
    assert other_labels == batch["labels"][0, :len(other_labels)].tolist()

    changed = batch["labels"].clone()  # a response target does count
    first_answer = int((changed[0] != -100).nonzero()[0])
    changed[0, first_answer] = 1234
    assert next_token_loss(logits, changed).item() != pytest.approx(loss.item(), abs=1e-4)


def test_truncation_cuts_the_prompt_from_the_left_and_counts(tokenizer):
    long_prompt = "一二三四五六七八九十" * 3
    rows = [{"prompt": long_prompt, "response": "好的"}, {"prompt": "你好", "response": "在"},
            {"prompt": "说", "response": "天地玄黄宇宙洪荒日月盈昃"}]
    pairs = ChatPairs(rows, tokenizer, max_length=9)
    assert len(pairs) == 3 and pairs.num_truncated == 2 and pairs.num_response_cut == 1
    inputs, labels = pairs[0]
    # 10 template tokens: [CLS] + the last 5 prompt characters + [ANS] + 好 的 [SEP]; the model reads 9
    assert inputs == [CLS] + char_ids("六七八九十", tokenizer) + [ANS] + char_ids("好的", tokenizer)
    assert labels == [-100] * 6 + char_ids("好的", tokenizer) + [SEP]
    assert pairs[1] == ([CLS] + char_ids("你好", tokenizer) + [ANS] + char_ids("在", tokenizer),
                        [-100, -100, -100] + char_ids("在", tokenizer) + [SEP])
    assert max(pairs.lengths) <= 9
    warning = pairs.truncation_warning("train")
    assert "2 of 3 train pairs do not fit in the 9 positions" in warning and "1 of them" in warning
    assert "\n" not in warning
    assert ChatPairs(rows[1:2], tokenizer, 9).truncation_warning("train") is None


# --- conversations: several turns, alpaca and messages files ------------------------------------------------------

def test_only_assistant_tokens_carry_loss_in_a_three_turn_conversation(tokenizer):
    """system + three (user, assistant) turns: the labels are exactly the three answers and their [SEP]s, each
    predicted from the token before it; system text, user turns, [ANS] and [CLS] are never targets."""
    turns = [("system", "你是诗人"), ("user", "春"), ("assistant", "花开"), ("user", "夏"), ("assistant", "雨"),
             ("user", "秋"), ("assistant", "叶落")]
    pairs = ChatPairs([{"messages": turns}], tokenizer, max_length=64)
    def c(text):
        return char_ids(text, tokenizer)

    full = ([CLS] + c("你是诗人") + [SEP] + c("春") + [ANS] + c("花开") + [SEP] + c("夏") + [ANS] + c("雨") + [SEP]
            + c("秋") + [ANS] + c("叶落") + [SEP])
    inputs, labels = pairs[0]
    assert inputs == full[:-1]
    # full: [CLS] 你 是 诗 人 [SEP] 春 [ANS] 花 开 [SEP] 夏 [ANS] 雨 [SEP] 秋 [ANS] 叶 落 [SEP]
    #        0     1  2  3  4  5     6  7     8  9  10    11 12    13 14    15 16    17 18 19
    answer_positions = [8, 9, 10, 13, 14, 17, 18, 19]
    expected = [-100] * len(inputs)
    for position in answer_positions:
        expected[position - 1] = full[position]
    assert [full[p] for p in answer_positions] == c("花开") + [SEP] + c("雨") + [SEP] + c("叶落") + [SEP]
    assert labels == expected
    one = ChatPairs([{"messages": turns[1:3]}], tokenizer, 64)[0]
    assert one == chat_example(*ct.apply_chat_template("春", "花开", tokenizer)[:2])  # one exchange: the SFT layout


def test_alpaca_messages_and_our_pairs_read_alike(tmp_path, tokenizer):
    from plumbing.records import read_chat_pairs

    ours = write_jsonl(tmp_path / "ours.jsonl", [{"prompt": "翻译：你好", "response": "hello"}])
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "翻译：", "input": "你好", "output": "hello"},
                                                      {"instruction": "写一句诗", "input": "", "output": "床前明月光"}],
                                                     ensure_ascii=False), encoding="utf-8")
    messages = write_jsonl(tmp_path / "messages.jsonl", [{"messages": [
        {"role": "system", "content": "你是助手"}, {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "再见"},
        {"role": "assistant", "content": "再见"}]}])
    rows = read_chat_pairs([ours, str(tmp_path / "alpaca.json"), messages], "--train_files")
    in_folder = read_chat_pairs(str(tmp_path), "--train_files")  # a folder: its files in name order
    assert in_folder == read_chat_pairs(sorted(map(str, tmp_path.iterdir())), "--train_files") and len(in_folder) == 4
    assert [r["messages"] for r in rows] == [
        [("user", "翻译：你好"), ("assistant", "hello")],
        [("user", "翻译：\n你好"), ("assistant", "hello")],
        [("user", "写一句诗"), ("assistant", "床前明月光")],
        [("system", "你是助手"), ("user", "你好"), ("assistant", "你好！"), ("user", "再见"), ("assistant", "再见")]]
    assert (rows[3]["prompt"], rows[3]["response"]) == ("再见", "再见")  # the last exchange, for the samples table
    pairs = ChatPairs(rows, tokenizer, 64)
    assert pairs[0] == ChatPairs([{"prompt": "翻译：你好", "response": "hello"}], tokenizer, 64)[0]
    assert sum(label != -100 for label in pairs[3][1]) == len(ct.encode("你好！", tokenizer)) + 1 + 2 + 1


def test_system_flag_opens_conversations_without_their_own(tmp_path):
    """read_chat_pairs(..., system) (1-SFT.py --system) puts the text first in every conversation with no system
    message; a record with its own keeps it."""
    from plumbing.records import read_chat_pairs

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "你好", "response": "嗯"},
                                              {"prompt": "再见", "response": "好", "system": "你是诗人"}])
    rows = read_chat_pairs(path, "--train_files", "你是助手")
    assert [r["messages"] for r in rows] == [[("system", "你是助手"), ("user", "你好"), ("assistant", "嗯")],
                                              [("system", "你是诗人"), ("user", "再见"), ("assistant", "好")]]
    assert read_chat_pairs(path, "--train_files")[0]["messages"] == [("user", "你好"), ("assistant", "嗯")]


def test_prompt_records_of_the_alignment_stages(tmp_path, tokenizer):
    """PPO/GRPO prompts (records.prompt_of): ours, alpaca and messages records; one user turn stays the plain
    string (so the layout is the old one), a conversation becomes turns laid out by chat_messages_ids; a record
    that does not end with a user turn is a one-line error naming its line."""
    from chinese_tokenizer import ANSWER_ID, CLS_ID, SEP_ID, chat_prompt_ids
    from plumbing.cli import UserError
    from plumbing.records import read_prompt_files

    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "写诗"}, {"instruction": "翻译", "input": "你好", "output": "hi"},
        {"messages": [{"role": "user", "content": "写诗"}, {"role": "assistant", "content": "好"}]},
        {"messages": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "嗯"},
                      {"role": "user", "content": "写诗"}]},
        {"prompt": "写诗", "system": "你是诗人"}])
    prompts = read_prompt_files(str(path), "--prompts_file")
    assert prompts == ["写诗", "翻译\n你好", "写诗", (("user", "你好"), ("assistant", "嗯"), ("user", "写诗")),
                       (("system", "你是诗人"), ("user", "写诗"))]
    def e(text):
        return ct.encode(text, tokenizer)

    assert chat_prompt_ids(prompts[3], tokenizer) == [CLS_ID] + e("你好") + [ANSWER_ID] + e("嗯") + [SEP_ID] + \
        e("写诗") + [ANSWER_ID]
    assert chat_prompt_ids(prompts[4], tokenizer) == [CLS_ID] + e("你是诗人") + [SEP_ID] + e("写诗") + [ANSWER_ID]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}, {"messages": [{"role": "assistant",
                                                                               "content": "y"}]}])
    with pytest.raises(UserError, match="bad.jsonl line 2: "):
        read_prompt_files(str(bad), "--prompts_file")
    text = tmp_path / "p.txt"  # one prompt per line, as generate.py --prompts_file reads it
    text.write_text("写诗\n\n  \n翻译 你好\n", encoding="utf-8")
    assert read_prompt_files(str(text), "--prompts_file") == ["写诗", "翻译 你好"]
    (tmp_path / "blank.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(UserError, match="--prompts_file .*blank.txt holds no prompt"):
        read_prompt_files(str(tmp_path / "blank.txt"), "--prompts_file")


def test_messages_need_content_and_a_system_field_opens_them(tmp_path):
    """An empty message is refused with its line and index; a "system" field beside "messages" opens the
    conversation unless the messages start with their own; a .json holding one object (not records) says so."""
    from plumbing.cli import UserError
    from plumbing.records import read_chat_pairs

    turn = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "嗯"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": turn, "system": "你是助手"},
                                              {"messages": [{"role": "system", "content": "别的"}] + turn,
                                               "system": "你是助手"}])
    assert [r["messages"][0] for r in read_chat_pairs(str(path), "--train_files")] == [("system", "你是助手"),
                                                                                       ("system", "别的")]
    empty = write_jsonl(tmp_path / "e.jsonl", [{"messages": [turn[0], {"role": "assistant", "content": " "}]}])
    with pytest.raises(UserError, match="e.jsonl line 1: messages message 2 \\(assistant\\) has empty content"):
        read_chat_pairs(str(empty), "--train_files")
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"prompt": "a", "response": "b"}]}, indent=2),
                                           encoding="utf-8")
    with pytest.raises(UserError, match="wrapped.json holds one JSON object \\(keys: data\\), not records"):
        read_chat_pairs(str(tmp_path / "wrapped.json"), "--train_files")


def test_parquet_conversations_read_as_their_json_lines(tmp_path):
    """The Hub publishes data sets as parquet: the same alpaca and messages records as .parquet read exactly as
    from .jsonl, and a bad row is named by its row number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plumbing.cli import UserError
    from plumbing.records import read_chat_pairs

    records = {"alpaca": [{"instruction": "翻译：", "input": "你好", "output": "hello"},
                          {"instruction": "写一句诗", "input": "", "output": "床前明月光"}],
               "messages": [{"messages": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "嗯"},
                                          {"role": "user", "content": "再见"},
                                          {"role": "assistant", "content": "好"}]}]}
    for name, rows in records.items():
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        assert read_chat_pairs(str(tmp_path / f"{name}.parquet"), "--train_files") == \
            read_chat_pairs(write_jsonl(tmp_path / f"{name}.jsonl", rows), "--train_files")
    pq.write_table(pa.Table.from_pylist([{"instruction": "a", "output": "b"}, {"instruction": "c", "output": ""}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(UserError, match="bad.parquet row 2: field 'output'"):
        read_chat_pairs(str(tmp_path / "bad.parquet"), "--train_files")


@pytest.mark.parametrize("name, content, words", [
    ("a.jsonl", '{"instruction": "写诗", "input": ""}\n', "a.jsonl line 1: field 'output' is missing"),
    ("b.jsonl", '{"prompt": "x", "response": "y"}\n\n{"prompt": "x"}\n', "b.jsonl line 3: field 'response'"),
    ("c.jsonl", '{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}\n',
     "c.jsonl line 1: message 1 has role 'bot'"),
    ("d.jsonl", '{"messages": [{"role": "user", "content": "x"}]}\n', "d.jsonl line 1: the conversation ends"),
    ("e.jsonl", '{"messages": "hello"}\n', "e.jsonl line 1: field 'messages' must be a non-empty list"),
    ("f.json", '[{"instruction": "a", "output": "b"}, {"instruction": "c"}]', "f.json item 2: field 'output'"),
])
def test_bad_conversation_records_name_file_line_and_field(tmp_path, name, content, words):
    from plumbing.cli import UserError
    from plumbing.records import read_chat_pairs

    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as caught:
        read_chat_pairs([str(tmp_path / name)], "--train_files")
    message = str(caught.value)
    assert words.split(": ", 1)[-1] in message and name in message and "\n" not in message


def test_length_grouped_batches_by_hand():
    assert length_grouped_batches([5, 1, 3, 1, 4], 2) == [[1, 3], [2, 4], [0]]
    assert length_grouped_batches([2, 2, 2], 5) == [[0, 1, 2]]


def test_sample_prompts_include_reviews_and_xiehouyu():
    rows = [{"prompt": p, "response": "x"} for p in
            ("解释词语：甲", "你好", "写一条好评。", "补全歇后语：猫哭老鼠——", "写一条差评。", "乙——下一句是什么？")]
    picked = SFT.pick_sample_rows(rows, 6)
    assert picked[:5] == [2, 4, 3, 5, 0] and sorted(picked) == list(range(6))
    assert len(SFT.pick_sample_rows(rows, 3)) == 3


# --- 1-SFT.py end to end (in-process, tiny model) ----------------------------------------------------------------

PAIRS = [("你好", "你好呀"), ("一加一等于几？", "等于二"), ("天空是什么颜色？", "蓝色"),
         ("补全歇后语：猫哭老鼠——", "假慈悲")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Tiny data and a tiny pretrain checkpoint made by 0-PRETRAIN.py."""
    root = tmp_path_factory.mktemp("sft")
    text = {"text": "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。床前明月光，疑是地上霜。" * 3}
    train_text, val_text = write_jsonl(root / "text.jsonl", [text]), write_jsonl(root / "val_text.jsonl", [text])
    write_jsonl(root / "pairs.jsonl", [{"prompt": p, "response": r} for p, r in PAIRS])
    pretrain = load_script("pretrain_stage", "0-PRETRAIN.py")
    code = run_main(pretrain, ["--preset", "tiny", "--max_steps", 2, "--batch_size", 1, "--eval_every", 2,
                               "--train_files", train_text, "--val_files", val_text,
                               "--output_dir", root / "pretrain"])
    assert code == 0
    return root


def sft_args(root, output_dir, *extra, pairs="pairs.jsonl"):
    return ["--preset", "tiny", "--init", root / "pretrain", "--train_files", root / pairs,
            "--val_files", root / pairs, "--output_dir", output_dir, *extra]


@pytest.mark.slow
def test_sft_memorises_pairs_and_stops_at_sep(workdir, tokenizer):
    out = workdir / "sft"
    assert run_main(SFT, sft_args(workdir, out, "--max_steps", 40, "--learning_rate", 1e-2, "--eval_every", 40)) == 0
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["stage"] == "sft" and config["step"] == 40
    assert config["metrics"]["val_loss"] < 0.5 < config["metrics"]["val_loss_before_sft"]

    model, _, _ = load_checkpoint(str(out), "gpt")  # answered here without the script's helpers
    for prompt, response in PAIRS:
        idx = torch.tensor([[CLS] + ct.encode(prompt, tokenizer) + [ANS]])  # (1, P)
        new = generate(model, idx, 20, 64, eos_id=SEP)[0, idx.shape[1]:].tolist()
        assert new == ct.encode(response, tokenizer) + [SEP]  # the answer, then [SEP], then nothing more

    samples = (out / "samples.md").read_text(encoding="utf-8")
    for prompt, response in PAIRS:
        assert f"| {prompt} | {response} | {response} |" in samples

    before = dir_digest(out)  # a second run without --overwrite refuses and touches nothing
    assert run_main(SFT, sft_args(workdir, out, "--max_steps", 2)) == 2
    assert dir_digest(out) == before


@pytest.mark.slow
def test_sft_trains_on_alpaca_and_multi_turn_files(workdir, tokenizer):
    """1-SFT.py reads an alpaca .json array and a multi-turn messages file; the multi-turn model learns each second
    answer given the first exchange as context."""
    alpaca = [{"instruction": p, "input": "", "output": r} for p, r in PAIRS]
    (workdir / "alpaca.json").write_text(json.dumps(alpaca, ensure_ascii=False), encoding="utf-8")
    first = [{"role": "user", "content": PAIRS[0][0]}, {"role": "assistant", "content": PAIRS[0][1]}]
    write_jsonl(workdir / "chat.jsonl", [{"messages": first + [{"role": "user", "content": p},
                                                              {"role": "assistant", "content": r}]}
                                         for p, r in PAIRS[1:]])
    for name in ("alpaca.json", "chat.jsonl"):
        out = workdir / f"sft-{name}"
        assert run_main(SFT, sft_args(workdir, out, "--max_steps", 40, "--learning_rate", 1e-2, "--eval_every", 40,
                                      pairs=name)) == 0
        metrics = json.loads((out / "config.json").read_text(encoding="utf-8"))["metrics"]
        assert metrics["val_loss"] < 0.5 < metrics["val_loss_before_sft"]
    model, _, _ = load_checkpoint(str(workdir / "sft-chat.jsonl"), "gpt")
    for prompt, response in PAIRS[1:]:
        ids = ct.chat_messages_ids([(m["role"], m["content"]) for m in first] + [("user", prompt)], tokenizer)
        new = generate(model, torch.tensor([ids]), 20, 64, eos_id=SEP)[0, len(ids):].tolist()
        assert new == ct.encode(response, tokenizer) + [SEP]


@pytest.mark.slow
def test_resume_is_bit_identical(workdir):
    rows = [{"prompt": p + "？" * k, "response": r} for k in range(2) for p, r in PAIRS]
    write_jsonl(workdir / "pairs8.jsonl", rows)  # 8 pairs, batches of 2: the order of batches matters
    common = ["--max_steps", 6, "--batch_size", 2, "--eval_every", 6, "--num_samples", 1]
    straight, halves = workdir / "straight", workdir / "halves"
    assert run_main(SFT, sft_args(workdir, straight, *common, pairs="pairs8.jsonl")) == 0
    assert run_main(SFT, sft_args(workdir, halves, *common, "--stop_after", 3, pairs="pairs8.jsonl")) == 0
    assert json.loads((halves / "config.json").read_text())["step"] == 3 and (halves / "state").is_dir()
    assert run_main(SFT, sft_args(workdir, halves, *common, "--resume", pairs="pairs8.jsonl")) == 0
    assert (straight / "model.safetensors").read_bytes() == (halves / "model.safetensors").read_bytes()
    assert not (halves / "state").exists()


@pytest.mark.slow
def test_resume_after_a_ctrl_c_at_the_last_step_still_writes_the_answers(workdir, monkeypatch):
    """Ctrl-C at the last step saves a state at max_steps; --resume then trains nothing and must still write
    samples.md with the final model's answers (they came from the evaluation that ran before the Ctrl-C)."""
    from plumbing import training

    write_jsonl(workdir / "pairs8.jsonl", [{"prompt": p + "？" * k, "response": r} for k in range(2) for p, r in PAIRS])
    common = ["--max_steps", 4, "--batch_size", 2, "--eval_every", 4, "--num_samples", 2]
    straight, stopped = workdir / "straight-4", workdir / "stopped-4"
    assert run_main(SFT, sft_args(workdir, straight, *common, pairs="pairs8.jsonl")) == 0
    calls = []
    real = training.StopSignal.requested
    monkeypatch.setattr(training.StopSignal, "requested", lambda self, acc: calls.append(1) or len(calls) == 4)
    assert run_main(SFT, sft_args(workdir, stopped, *common, pairs="pairs8.jsonl")) == 130
    assert json.loads((stopped / "config.json").read_text())["step"] == 4 and (stopped / "state").is_dir()
    monkeypatch.setattr(training.StopSignal, "requested", real)
    assert run_main(SFT, sft_args(workdir, stopped, *common, "--resume", pairs="pairs8.jsonl")) == 0
    assert (stopped / "samples.md").read_text(encoding="utf-8") == (straight / "samples.md").read_text(encoding="utf-8")
    assert "| " in (stopped / "samples.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_missing_init_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "1-SFT.py"), "--init", str(tmp_path / "nothing"),
                             "--output_dir", str(tmp_path / "sft")], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "0-PRETRAIN.py" in lines[0] and "--init" in lines[0]
    assert not (tmp_path / "sft").exists()
