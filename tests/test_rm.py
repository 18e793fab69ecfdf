"""Tests for the reward model stage: plumbing/reward.py (scoring, the pair-accuracy rule),
batching.pad_right and 2-RM.py (its losses and metrics)."""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chinese_tokenizer import PAD_ID, SEP_ID, apply_chat_template, encode
from gpt_fast import speed_up
from gpt_model import GPTModel, RewardModel, get_preset
from plumbing.batching import pad_right
from plumbing.checkpoint import load_checkpoint, save_checkpoint
from plumbing.cli import UserError, run
from plumbing.reward import score_texts

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_script(file_name):
    """Import a numbered script (its file name is not a valid module name) to call its ``main`` in-process."""
    spec = importlib.util.spec_from_file_location(file_name[:-3].replace("-", "_"), REPO_ROOT / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RM = load_script("2-RM.py")


def random_reward_model(seed=0, **changes):
    """A tiny ``RewardModel`` over the real vocabulary, weights drawn large enough that every token matters."""
    torch.manual_seed(seed)
    model = RewardModel(get_preset("tiny").replace(**changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


# --------------------------------------------------------------------------------------------------------------
# padding and the last real token


def test_pad_right_by_hand():
    batch = pad_right([[5, 6, 7], [8], [9, 10]])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD_ID, PAD_ID], [9, 10, PAD_ID]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    with pytest.raises(ValueError):
        pad_right([[1], []])


def test_score_ignores_padding(tokenizer):
    """A text scores the same alone and inside a right-padded batch with longer texts, and the score is the head
    applied to the unpadded sequence's final hidden state (computed here without the model's gather)."""
    model = random_reward_model()
    prompts = ["写一条好评：", "写一条好评：", "请写一条正面的用户评价。"]
    responses = ["好", "房间干净，早餐丰富，服务员也很热情，下次还来。", "一般般"]
    alone = [score_texts(model, tokenizer, [p], [r], batch_size=1)[0] for p, r in zip(prompts, responses)]
    together = score_texts(model, tokenizer, prompts, responses, batch_size=3)
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), rtol=1e-5, atol=1e-5)
    for p, r, score in zip(prompts, responses, alone):
        ids = torch.tensor([apply_chat_template(p, r, tokenizer)[0]])  # (1, T)
        hidden, _ = model.backbone.hidden_states(ids)  # (1, T, E)
        by_hand = (hidden[0, -1] @ model.head.linear.weight[0] + model.head.linear.bias[0]).item()
        assert score == pytest.approx(by_hand, abs=1e-5)
    assert len({round(s, 4) for s in alone}) == 3  # the texts really score differently


def test_score_moves_with_the_last_real_token_not_with_padding(tokenizer):
    model = random_reward_model(seed=1)
    short = apply_chat_template("写一条好评：", "很好", tokenizer)[0]
    long = apply_chat_template("写一条好评：", "位置方便，价格也合适", tokenizer)[0]
    batch = pad_right([short, long])
    ids, mask = batch["input_ids"], batch["attention_mask"]  # (2, T)
    assert ids[0, len(short) - 1] == SEP_ID and mask[0, len(short):].sum() == 0
    with torch.no_grad():
        base = model(ids, mask)["rewards"]  # (2,)
        other_pads = ids.clone()
        other_pads[0, len(short):] = torch.randint(1000, 8000, (ids.shape[1] - len(short),))
        assert torch.equal(model(other_pads, mask)["rewards"], base)
        other_last = ids.clone()
        other_last[0, len(short) - 1] = encode("差", tokenizer)[0]
        moved = model(other_last, mask)["rewards"]
    assert abs(moved[0] - base[0]) > 1e-3
    assert moved[1] == base[1]  # the other row is untouched


# --------------------------------------------------------------------------------------------------------------
# objectives and metrics


def test_pairwise_loss_by_hand():
    r_chosen, r_rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 2, 0, -2
    expected = (math.log1p(math.exp(-2)) + math.log(2) + math.log1p(math.exp(2))) / 3
    assert RM.pairwise_loss(r_chosen, r_rejected).item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(0.982334, abs=1e-6)
    far = RM.pairwise_loss(torch.tensor([-100.0]), torch.tensor([100.0])).item()  # no overflow to inf
    assert far == pytest.approx(200.0)


def test_pairwise_loss_gradient_pushes_chosen_up():
    r_chosen = torch.tensor([0.5], requires_grad=True)
    r_rejected = torch.tensor([0.0], requires_grad=True)
    RM.pairwise_loss(r_chosen, r_rejected).backward()
    # d/dr_c of -log sigmoid(r_c - r_r) = -(1 - sigmoid(0.5))
    assert r_chosen.grad.item() == pytest.approx(-(1 - 1 / (1 + math.exp(-0.5))), rel=1e-6)
    assert r_rejected.grad.item() == pytest.approx(-r_chosen.grad.item())


def test_pointwise_loss_by_hand():
    loss = RM.pointwise_loss(torch.tensor([0.0, 2.0]), torch.tensor([1, 0]))
    assert loss.item() == pytest.approx((math.log(2) + math.log1p(math.exp(2))) / 2, rel=1e-6)


def test_one_tie_rule_for_every_pair_accuracy():
    """RM, DPO and the naive Bayes baseline count a tie as half a pair ranked right (reward.pairs_ranked_right)."""
    from plumbing.baselines import pair_accuracy
    from plumbing.reward import pairs_ranked_right

    assert pairs_ranked_right([1.0, 0.0, 2.0], [0.0, 0.0, 3.0]).item() == 1.5
    dpo = load_script("3-DPO.py")
    assert not hasattr(dpo, "pairs_right")  # DPO counts with the shared rule, not its own

    class Same:  # a scorer that cannot tell any two texts apart
        def log_odds(self, text):
            return 0.0

    assert pair_accuracy(Same(), [("好", "坏"), ("行", "差")]) == 0.5


def test_pair_metrics_by_hand():
    m = RM.pair_metrics([3.0, 1.0, 0.5, -1.0], [1.0, 2.0, 0.5, -3.0])  # differences 2, -1, 0 (a tie), 2
    assert m["accuracy"] == pytest.approx(2.5 / 4)  # the tie counts half, as in DPO's accuracy and the baseline's
    assert m["margin"] == pytest.approx(0.75)
    expected_loss = sum(math.log1p(math.exp(-d)) for d in (2, -1, 0, 2)) / 4
    assert m["loss"] == pytest.approx(expected_loss, rel=1e-6)


# --------------------------------------------------------------------------------------------------------------
# the stage script


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def easy_pairs(n, seed):
    """Pairs whose only difference in kind is the word: chosen says 好, rejected says 差, at a random place."""
    g = torch.Generator().manual_seed(seed)
    filler = "天地人山水风云日月星"

    def sentence(word):
        chars = [filler[i] for i in torch.randint(0, len(filler), (6,), generator=g).tolist()]
        chars.insert(int(torch.randint(0, 7, (1,), generator=g)), word)
        return "".join(chars)

    return [{"prompt": "评价：", "chosen": sentence("好"), "rejected": sentence("差")} for _ in range(n)]


@pytest.fixture(scope="module")
def easy_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm_data")
    return {split: write_jsonl(d / f"{split}.jsonl", easy_pairs(n, seed))
            for split, n, seed in (("train", 96, 0), ("val", 32, 1), ("test", 48, 2))}


@pytest.fixture(scope="module")
def tiny_pretrain(tmp_path_factory):
    """A tiny checkpoint written by 0-PRETRAIN.py (a few steps on a few hundred characters)."""
    d = tmp_path_factory.mktemp("pretrain")
    text = "今天天气很好，我们去山上看风景。\n\n这家店的菜太差了，再也不来。\n\n" * 20
    (d / "train.txt").write_text(text, encoding="utf-8")
    out = d / "ckpt"
    code = load_script("0-PRETRAIN.py").main(["--preset", "tiny", "--max_steps", "2", "--batch_size", "2",
                                              "--train_files", str(d / "train.txt"), "--val_files",
                                              str(d / "train.txt"), "--output_dir", str(out),
                                              "--eval_every", "100"])
    assert code == 0
    return str(out)


@pytest.fixture(scope="module")
def random_init(tmp_path_factory, tokenizer):
    """A tiny GPT checkpoint with random weights and dropout on (so exact resume must restore the RNG)."""
    path = tmp_path_factory.mktemp("init") / "ckpt"
    torch.manual_seed(0)
    save_checkpoint(str(path), GPTModel(get_preset("tiny").replace(drop_rate=0.2)), tokenizer, {"stage": "pretrain"})
    return str(path)


def rm_args(data, init, out, *extra):
    return ["--preset", "tiny", "--init", init, "--output_dir", str(out), "--train_files", data["train"],
            "--val_files", data["val"], "--test_files", data["test"], *extra]


@pytest.fixture(scope="module")
def trained_rm(easy_data, tiny_pretrain, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "ckpt"
    assert RM.main(rm_args(easy_data, tiny_pretrain, out, "--max_steps", "12", "--eval_every", "6")) == 0
    return out


def as_conversations(path, out):
    """The same pairs written as chosen/rejected conversations (a user turn, then each answer)."""
    rows = []
    for line in open(path, encoding="utf-8"):
        pair = json.loads(line)
        rows.append({side: [{"role": "user", "content": pair["prompt"]},
                            {"role": "assistant", "content": pair[side]}] for side in ("chosen", "rejected")})
    return write_jsonl(out, rows)


@pytest.mark.slow
def test_rm_on_conversation_pairs_is_the_rm_on_flat_pairs(trained_rm, easy_data, tiny_pretrain, tmp_path):
    """chosen/rejected conversations that hold one exchange each are the very same examples as the flat pairs:
    the RM trained on them is byte-identical."""
    data = {split: as_conversations(path, tmp_path / f"{split}.jsonl") for split, path in easy_data.items()}
    out = tmp_path / "rm"
    assert RM.main(rm_args(data, tiny_pretrain, out, "--max_steps", "12", "--eval_every", "6")) == 0
    assert (out / "model.safetensors").read_bytes() == (trained_rm / "model.safetensors").read_bytes()


def test_preference_records_in_every_shape(tmp_path, tokenizer):
    from plumbing.records import read_preference_pairs

    system_turns = [{"role": "system", "content": "甲"}, {"role": "user", "content": "你好"},
                    {"role": "assistant", "content": "好"}, {"role": "user", "content": "再见"}]
    rows = [{"prompt": "评价：", "chosen": "好", "rejected": "差"},
            {"prompt": system_turns, "chosen": "拜", "rejected": "滚"},
            {"chosen": system_turns + [{"role": "assistant", "content": "拜"}],
             "rejected": system_turns + [{"role": "assistant", "content": "滚"}]},
            {"prompt": system_turns[:2], "chosen": [{"role": "assistant", "content": "在"}],
             "rejected": [{"role": "assistant", "content": "不在"}]}]
    triples = read_preference_pairs([write_jsonl(tmp_path / "p.jsonl", rows)], "--train_files")
    turns = (("system", "甲"), ("user", "你好"), ("assistant", "好"), ("user", "再见"))
    assert triples == [("评价：", "好", "差"), (turns, "拜", "滚"), (turns, "拜", "滚"), (turns[:2], "在", "不在")]
    ids, mask, _ = apply_chat_template(turns, "拜", tokenizer)
    c = tokenizer.convert_tokens_to_ids
    assert ids == [101] + c(["甲"]) + [102] + c(list("你好")) + [5] + c(["好"]) + [102] + c(list("再见")) + [5] + \
        c(["拜"]) + [102]
    assert mask == [0] * (len(ids) - 2) + [1, 1]  # only the answer being scored (and its [SEP])


@pytest.mark.parametrize("row, words", [
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "c"}]},
     "must share every message but their last"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "a"}]},
     "must be the assistant's answer"),
    ({"prompt": "a", "chosen": "b"}, "field 'rejected' is missing"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "field 'chosen' must be a string or a non-empty list"),
])
def test_bad_preference_records_are_one_line_errors(tmp_path, row, words):
    from plumbing.cli import UserError
    from plumbing.records import read_preference_pairs

    with pytest.raises(UserError, match=re.escape(words)) as caught:
        read_preference_pairs([write_jsonl(tmp_path / "bad.jsonl", [row])], "--train_files")
    assert "bad.jsonl line 1" in str(caught.value)


@pytest.mark.slow
def test_end_to_end_learns_an_easy_preference(trained_rm, easy_data, tokenizer):
    config = json.loads((trained_rm / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "reward" and config["stage"] == "rm" and config["step"] == 12
    metrics = config["metrics"]
    assert metrics["test_accuracy"] >= 0.9 and metrics["test_margin"] > 0.5
    assert metrics["val_accuracy"] >= 0.9
    rows = [json.loads(line) for line in (trained_rm / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in rows if "val_accuracy" in r] == [6, 12]
    assert rows[-1]["test_accuracy"] == metrics["test_accuracy"]
    assert (trained_rm / "loss_curve.png").is_file() and not (trained_rm / "state").exists()

    # the reported test numbers agree with scoring the test file independently
    model, tok, _ = load_checkpoint(str(trained_rm), "reward")
    pairs = [json.loads(line) for line in open(easy_data["test"], encoding="utf-8")]
    diffs = []
    with torch.no_grad():
        for pair in pairs:
            c = torch.tensor([apply_chat_template(pair["prompt"], pair["chosen"], tok, 64)[0]])
            r = torch.tensor([apply_chat_template(pair["prompt"], pair["rejected"], tok, 64)[0]])
            diffs.append((model(c)["rewards"] - model(r)["rewards"]).item())
    assert metrics["test_accuracy"] == pytest.approx(sum(d > 0 for d in diffs) / len(diffs))
    assert metrics["test_margin"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-4)


@pytest.mark.slow
def test_score_cli_prints_one_float_per_text(trained_rm, tmp_path):
    lines = tmp_path / "texts.txt"
    lines.write_text("山水好\n\n风云差\n", encoding="utf-8")  # the blank line is skipped
    texts = ["天好", "天差"]
    cmd = [sys.executable, str(REPO_ROOT / "2-RM.py"), "--score", "--checkpoint", str(trained_rm),
           "--prompt", "评价：", "--text", texts[0], "--text", texts[1], "--texts_file", str(lines)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 blank line(s)" in done.stderr  # the scores no longer line up with the file's lines: said
    scores = [float(line) for line in done.stdout.splitlines()]
    model, tok, _ = load_checkpoint(str(trained_rm), "reward")
    expected = [model(torch.tensor([apply_chat_template("评价：", t, tok)[0]]))["rewards"].item()
                for t in texts + ["山水好", "风云差"]]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores[0] > scores[1] and scores[2] > scores[3]


@pytest.mark.slow
def test_score_jsonl_in_process(trained_rm, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "评价：", "response": "日月好"},
                                              {"prompt": "评价：", "response": "日月差"}])
    assert RM.main(["--score", "--checkpoint", str(trained_rm), "--texts_file", rows]) == 0
    scores = [float(s) for s in capsys.readouterr().out.split()]
    model, tok, _ = load_checkpoint(str(trained_rm), "reward")
    expected = score_texts(model, tok, ["评价："] * 2, ["日月好", "日月差"], batch_size=1)
    assert scores == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_pointwise_objective_runs_on_labelled_texts(easy_data, tiny_pretrain, tmp_path):
    pairs = [json.loads(line) for line in open(easy_data["train"], encoding="utf-8")]
    labelled = write_jsonl(tmp_path / "labelled.jsonl", [{"text": p["chosen"], "label": 1} for p in pairs] +
                           [{"text": p["rejected"], "label": 0} for p in pairs])
    out = tmp_path / "rm"
    args = rm_args(easy_data, tiny_pretrain, out, "--objective", "pointwise", "--max_steps", "12")
    args[args.index("--train_files") + 1] = labelled
    assert RM.main(args) == 0
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["objective"] == "pointwise" and config["metrics"]["test_accuracy"] >= 0.8


@pytest.mark.slow
def test_exact_resume(easy_data, random_init, tmp_path):
    """--stop_after 2 then --resume gives bit-identical weights to 4 straight steps, with dropout on."""
    init = random_init
    common = ("--max_steps", "4", "--eval_every", "2", "--save_every", "3")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert RM.main(rm_args(easy_data, init, straight, *common)) == 0
    assert RM.main(rm_args(easy_data, init, split, *common, "--stop_after", "2")) == 0
    assert json.loads((split / "config.json").read_text(encoding="utf-8"))["step"] == 2
    assert RM.main(rm_args(easy_data, init, split, *common, "--resume")) == 0
    assert (split / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    def drop(rows):
        return [{k: v for k, v in r.items() if k not in ("time_s", "flop_s")} for r in rows]  # no clock readings

    def read(d):
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]

    assert drop(read(split)) == drop(read(straight))


def run_cli(argv):
    """``cli.run(main)`` as ``python 2-RM.py`` runs it; returns the exit code."""
    with pytest.raises(SystemExit) as exit_info:
        run(RM.main, argv)
    return exit_info.value.code


@pytest.mark.slow
def test_ctrl_c_in_the_final_evaluation_keeps_the_trained_steps(easy_data, random_init, tmp_path, capsys,
                                                                monkeypatch):
    """Ctrl-C while the test split is scored, after the last step: the steps are saved as a resumable state and
    the stop line says how to go on; --resume then runs only the evaluation and writes what a straight run
    writes. (Before, nothing was saved: the steps were lost.)"""
    from plumbing import cli

    common = ("--max_steps", "4", "--eval_every", "2")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert RM.main(rm_args(easy_data, random_init, straight, *common)) == 0
    read = RM.read_preference_pairs

    def interrupted(files, what):
        if what == "--test_files":
            raise KeyboardInterrupt
        return read(files, what)

    monkeypatch.setattr(RM, "read_preference_pairs", interrupted)
    monkeypatch.setattr(cli, "interrupt_hint", None)
    capsys.readouterr()
    assert run_cli(rm_args(easy_data, random_init, stopped, *common)) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"stopped by SIGINT; the trained steps are saved in {stopped}") and "--resume" in err
    assert (stopped / "state" / "trainer_state.json").exists()
    monkeypatch.setattr(RM, "read_preference_pairs", read)
    assert RM.main(rm_args(easy_data, random_init, stopped, *common, "--resume")) == 0
    assert not (stopped / "state").exists()
    assert (stopped / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    def metrics(d):
        return json.loads((d / "config.json").read_text(encoding="utf-8"))["metrics"]

    assert metrics(stopped) == metrics(straight)


@pytest.mark.slow
def test_score_runs_in_fp32_unless_mixed_precision_asks(trained_rm, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "评价：", "response": "日月好山水"},
                                              {"prompt": "评价：", "response": "风云差"}])
    model, tok, _ = load_checkpoint(str(trained_rm), "reward")
    speed_up(model)  # as 2-RM.py --score runs it (under autocast its attention computes in fp32: gpt_fast.py)
    fp32 = score_texts(model, tok, ["评价："] * 2, ["日月好山水", "风云差"], batch_size=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = score_texts(model, tok, ["评价："] * 2, ["日月好山水", "风云差"], batch_size=1)
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) > 1e-4  # so that ignoring the flag would fail
    for flag, expected, says in ((["--mixed_precision", "bf16"], bf16, "(bf16)"), ([], fp32, "(fp32)")):
        assert RM.main(["--score", "--checkpoint", str(trained_rm), "--texts_file", rows, *flag]) == 0
        out, err = capsys.readouterr()
        assert [float(s) for s in out.split()] == pytest.approx(expected, abs=2e-6) and says in err


def test_score_with_a_language_model_names_the_flag(tiny_pretrain, capsys):
    assert run_cli(["--score", "--text", "好", "--checkpoint", str(tiny_pretrain)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --checkpoint ") and "reward model is needed" in err and "\n" not in err


def test_missing_parent_checkpoint_exits_2(easy_data, tmp_path, capsys):
    out = tmp_path / "rm"
    assert run_cli(rm_args(easy_data, str(tmp_path / "nope"), out)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "nope" in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--score"], "--text"),
    (["--text", "好"], "--score"),
    (["--score", "--text", "好", "--checkpoint", "/nonexistent/rm"], "/nonexistent/rm"),
    (["--score", "--texts_file", "/nonexistent/texts.txt"], "--texts_file /nonexistent/texts.txt"),
])
def test_bad_arguments_are_one_line_errors(argv, says, capsys):
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and says in err and "\n" not in err


def test_bad_label_and_existing_output_untouched(easy_data, random_init, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "好", "label": 1}, {"text": "差", "label": "bad"}])
    args = rm_args(easy_data, random_init, tmp_path / "out", "--objective", "pointwise")
    args[args.index("--train_files") + 1] = bad
    with pytest.raises(UserError, match=r"bad\.jsonl row 2"):
        RM.main(args)
    assert not (tmp_path / "out").exists()
    existing = Path(random_init) / "model.safetensors"
    before = existing.read_bytes()
    with pytest.raises(UserError, match="already holds a checkpoint"):
        RM.main(rm_args(easy_data, random_init, random_init))
    assert existing.read_bytes() == before
