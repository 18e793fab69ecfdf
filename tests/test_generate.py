"""Tests of generate.py, driven through its command line on tiny checkpoints with fixed random weights.

Expected texts are computed here independently of ``gpt_model.generate``: a plain greedy loop that runs the whole
window through the model at every step (no KV cache), and a reward model called on one sequence at a time.
"""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate as gen
from chinese_tokenizer import CLS_ID, SEP_ID, chat_prompt_ids, decode, encode, until_eos
from gpt_model import GPTModel, RewardModel, get_preset
from plumbing import inference
from plumbing.checkpoint import load_checkpoint, save_checkpoint
from plumbing.cli import run

REPO_ROOT = Path(__file__).resolve().parent.parent
# untied output head: with tied embeddings, random weights make greedy decoding repeat one token forever
TINY = get_preset("tiny").replace(tie_embeddings=False)
CONTEXT = TINY.context_length
PROMPT = "今天天气很好"


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return GPTModel(TINY).eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tokenizer, policy):
    """One set of weights saved as a pretrain and as an SFT checkpoint, and a tiny reward model."""
    root = tmp_path_factory.mktemp("ckpts")
    save_checkpoint(str(root / "pretrain"), policy, tokenizer, {"stage": "pretrain"})
    save_checkpoint(str(root / "sft"), policy, tokenizer, {"stage": "sft"})
    torch.manual_seed(1)
    save_checkpoint(str(root / "rm"), RewardModel(TINY).eval(), tokenizer, {"stage": "rm"})
    return {name: str(root / name) for name in ("pretrain", "sft", "rm")}


@torch.no_grad()
def greedy(model, ids, max_new_tokens, penalty=1.0, stop_at_sep=True):
    """Greedy decoding the long way: the last CONTEXT tokens through the model at every step."""
    ids, new = list(ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids[-CONTEXT:]]))["logits"][0, -1]  # (V,)
        if penalty != 1.0:
            for t in set(ids):
                logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        token = int(logits.argmax())
        if token == SEP_ID and stop_at_sep:
            break
        ids.append(token)
        new.append(token)
    return new


def cli(capsys, *argv):
    """Run generate.py's main with ``argv``; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        run(gen.main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_greedy_pretrain_is_plain_continuation(capsys, ckpts, policy, tokenizer):
    code, out, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--temperature", 0,
                         "--max_new_tokens", 12)
    assert code == 0
    expected = decode(greedy(policy, encode(PROMPT, tokenizer), 12), tokenizer)
    assert len(expected) >= 10
    assert out == expected + "\n"  # only the continuation, nothing else on stdout
    assert "plain continuation" in err


def test_an_unfinished_run_is_named_in_a_note(capsys, tmp_path, ckpts):
    """A checkpoint folder with a state/ (Ctrl-C, --stop_after) generates, with a note that it is unfinished."""
    import shutil

    stopped = tmp_path / "stopped"
    shutil.copytree(ckpts["pretrain"], stopped)
    (stopped / "state").mkdir()
    (stopped / "state" / "trainer_state.json").write_text(json.dumps({"step": 0, "settings": {"max_steps": 300}}),
                                                          encoding="utf-8")
    code, out, err = cli(capsys, "--checkpoint", stopped, "--prompt", PROMPT, "--max_new_tokens", 3)
    assert code == 0 and out and f"note: {stopped} is an unfinished run, stopped at step" in err and "of 300" in err
    code, _, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--max_new_tokens", 3)
    assert code == 0 and "unfinished" not in err


def test_greedy_sft_uses_chat_template_and_raw_turns_it_off(capsys, ckpts, policy, tokenizer):
    args = ("--prompt", PROMPT, "--temperature", 0, "--max_new_tokens", 12)
    _, chat_out, err = cli(capsys, "--checkpoint", ckpts["sft"], *args)
    assert "chat template" in err
    assert chat_out == decode(greedy(policy, chat_prompt_ids(PROMPT, tokenizer), 12), tokenizer) + "\n"
    _, raw_out, _ = cli(capsys, "--checkpoint", ckpts["sft"], "--raw", *args)
    assert raw_out == decode(greedy(policy, encode(PROMPT, tokenizer), 12), tokenizer) + "\n"
    assert chat_out != raw_out


def test_system_text_goes_before_the_prompt(capsys, ckpts, policy, tokenizer):
    """--system lays out [CLS] system [SEP] prompt [ANS] (by hand, from the tokens), the layout 1-SFT.py --system
    trains on; a plain-continuation checkpoint refuses it."""
    from chinese_tokenizer import ANSWER_ID, CLS_ID, SEP_ID

    ids = [CLS_ID] + encode("你是诗人", tokenizer) + [SEP_ID] + encode(PROMPT, tokenizer) + [ANSWER_ID]
    assert inference.prompt_to_ids(PROMPT, tokenizer, True, CONTEXT, system="你是诗人") == ids
    _, out, _ = cli(capsys, "--checkpoint", ckpts["sft"], "--prompt", PROMPT, "--system", "你是诗人",
                    "--temperature", 0, "--max_new_tokens", 8)
    assert out == decode(greedy(policy, ids, 8), tokenizer) + "\n"
    code, out, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--system", "你是诗人")
    assert code == 2 and "--system is for chat checkpoints" in err and "only continues text" in err and out == ""
    code, out, err = cli(capsys, "--checkpoint", ckpts["sft"], "--raw", "--prompt", PROMPT, "--system", "你是诗人")
    assert code == 2 and "--system and --raw do not go together" in err


def test_dtype_bf16_generates_with_bf16_weights(capsys, ckpts, policy, tokenizer):
    """--dtype bf16 casts the weights: the answer is what generate gives with a bf16 copy of the model (and the
    default is fp32, the cache-less reference above)."""
    import copy

    from gpt_model import generate

    args = ("--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--temperature", 0, "--max_new_tokens", 12)
    code, out, err = cli(capsys, *args, "--dtype", "bf16")
    assert code == 0 and "bfloat16 weights" in err
    ids = encode(PROMPT, tokenizer)
    half = copy.deepcopy(policy).to(torch.bfloat16)
    expected = generate(half, torch.tensor([ids]), 12, CONTEXT, eos_id=SEP_ID)[0, len(ids):].tolist()
    assert out == decode(until_eos(expected), tokenizer) + "\n"
    code, out, err = cli(capsys, *args)
    assert "float32 weights" in err and out == decode(greedy(policy, ids, 12), tokenizer) + "\n"


def test_greedy_with_repetition_penalty(capsys, ckpts, policy, tokenizer):
    _, out, _ = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--temperature", 0,
                    "--max_new_tokens", 30, "--repetition_penalty", 3.0)
    expected = greedy(policy, encode(PROMPT, tokenizer), 30, penalty=3.0)
    assert expected != greedy(policy, encode(PROMPT, tokenizer), 30)  # the penalty changes this continuation
    assert out == decode(expected, tokenizer) + "\n"


def test_answer_stops_at_sep(capsys, tmp_path, policy, tokenizer):
    # make [SEP] the greedy choice at step 3: its output row becomes a slightly larger copy of that step's winner
    ids = chat_prompt_ids(PROMPT, tokenizer)
    plain = greedy(policy, ids, 8)
    model = GPTModel(TINY).eval()
    model.load_state_dict(policy.state_dict())
    with torch.no_grad():
        model.out_head.weight[SEP_ID] = model.out_head.weight[plain[3]] * 1.05
    save_checkpoint(str(tmp_path / "sft"), model, tokenizer, {"stage": "sft"})
    full = greedy(model, ids, 8, stop_at_sep=False)
    assert SEP_ID in full[1:-1]  # the setup worked: [SEP] comes after some tokens, and more would follow it
    _, out, _ = cli(capsys, "--checkpoint", tmp_path / "sft", "--prompt", PROMPT, "--temperature", 0,
                    "--max_new_tokens", 8)
    assert out == decode(full[: full.index(SEP_ID)], tokenizer) + "\n"


def test_same_seed_same_text_other_seed_other_text(capsys, ckpts):
    args = ("--checkpoint", ckpts["sft"], "--prompt", PROMPT, "--temperature", 1.0, "--max_new_tokens", 15)
    first = cli(capsys, *args, "--seed", 7)[1]
    assert cli(capsys, *args, "--seed", 7)[1] == first
    assert cli(capsys, *args, "--seed", 8)[1] != first
    assert len(first) > 10


def test_top_k_1_is_greedy(capsys, ckpts, policy, tokenizer):
    _, out, _ = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--temperature", 1.5,
                    "--top_k", 1, "--max_new_tokens", 10)
    assert out == decode(greedy(policy, encode(PROMPT, tokenizer), 10), tokenizer) + "\n"


def test_more_new_tokens_than_the_context_get_a_note(capsys, ckpts):
    code, _, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--max_new_tokens", CONTEXT)
    assert code == 0 and f"--max_new_tokens {CONTEXT} are longer than the model's context of {CONTEXT}" in err
    code, _, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", PROMPT, "--max_new_tokens", CONTEXT - 1)
    assert code == 0 and "--max_new_tokens" not in err


def test_prompt_longer_than_context_keeps_its_end(capsys, ckpts, policy, tokenizer):
    prompt = "".join(chr(0x4E00 + 7 * i) for i in range(CONTEXT + 30))  # 94 distinct CJK characters
    ids = encode(prompt, tokenizer)
    assert len(ids) == CONTEXT + 30

    code, out, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompt", prompt, "--temperature", 0,
                         "--max_new_tokens", 5)
    assert code == 0 and f"keeping its last {CONTEXT}" in err
    assert out == decode(greedy(policy, ids[-CONTEXT:], 5), tokenizer) + "\n"

    code, out, err = cli(capsys, "--checkpoint", ckpts["sft"], "--prompt", prompt, "--temperature", 0,
                         "--max_new_tokens", 5)
    kept = chat_prompt_ids(prompt, tokenizer)
    kept = kept[:1] + kept[1:-1][-(CONTEXT - 2):] + kept[-1:]  # [CLS] and [ANS] stay, the prompt's start goes
    assert code == 0 and f"keeping its last {CONTEXT - 2}" in err
    assert out == decode(greedy(policy, kept, 5), tokenizer) + "\n"
    assert inference.prompt_to_ids(prompt, tokenizer, True, CONTEXT) == kept
    assert inference.prompt_to_ids(prompt, tokenizer, False, CONTEXT) == ids[-CONTEXT:]


@torch.no_grad()
def rm_score(model, tokenizer, prompt, response, ended=True):
    """The reward of ``[CLS] prompt [ANS] response [SEP]`` scored alone: the head's value at the last token (no
    ``[SEP]`` for a response that was cut off before it wrote one)."""
    ids = chat_prompt_ids(prompt, tokenizer) + encode(response, tokenizer) + ([SEP_ID] if ended else [])
    return float(model(torch.tensor([ids]))["rewards"][0])


def test_reward_returns_the_best_scoring_sample(capsys, tmp_path, ckpts, tokenizer):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}, ensure_ascii=False) + "\n", encoding="utf-8")
    args = ("--checkpoint", ckpts["sft"], "--prompts_file", prompts, "--temperature", 1.0, "--max_new_tokens", 8,
            "--num_samples", 4, "--seed", 1)
    # the same seed without --reward gives the same 4 samples, one JSON line each
    _, out, _ = cli(capsys, *args)
    samples = [json.loads(line)["response"] for line in out.splitlines()]
    assert len(samples) == 4 and len(set(samples)) == 4
    reward_model = load_checkpoint(ckpts["rm"], "reward")[0]
    # a sample of all 8 tokens was cut off: scored as generated, without a [SEP], as the alignment stages do
    ended = [len(encode(s, tokenizer)) < 8 for s in samples]
    assert not all(ended)  # so that appending [SEP] to every sample would fail
    scores = [rm_score(reward_model, tokenizer, PROMPT, s, e) for s, e in zip(samples, ended)]
    best = max(range(4), key=lambda i: scores[i])
    assert best != 0  # so that "always the first sample" would fail

    code, out, err = cli(capsys, *args, "--reward", ckpts["rm"])
    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["prompt"] == PROMPT and row["response"] == samples[best]
    assert row["score"] == pytest.approx(scores[best], abs=1e-4)
    assert all(f"{s:+.4f}" in err for s in scores)  # stderr lists every sample's score

    # --prompt prints the best answer alone on stdout
    _, out, _ = cli(capsys, *args[:2], "--prompt", PROMPT, *args[4:], "--reward", ckpts["rm"])
    assert out == samples[best] + "\n"


def test_best_of_n_monitors(capsys, tmp_path, ckpts):
    """--monitors summarises best-of-k for k = 1, 2, 4 from one run of 4 samples: best-of-4 is the kept answers,
    best-of-k the best of each prompt's first k samples (read back from the scores stderr lists), with each KL bound."""
    pytest.importorskip("snownlp")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("写一条好评：\n今天天气\n", encoding="utf-8")
    answers, monitors = tmp_path / "answers.jsonl", tmp_path / "monitors.json"
    code, _, err = cli(capsys, "--checkpoint", ckpts["sft"], "--prompts_file", prompts, "--output", answers,
                       "--reward", ckpts["rm"], "--num_samples", 4, "--temperature", 1.0, "--max_new_tokens", 6,
                       "--monitors", monitors)
    assert code == 0, err
    rows = [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines()]
    scores = [float(line.split("score ")[1].split()[0]) for line in err.splitlines() if " sample " in line]
    per_prompt = [scores[:4], scores[4:]]  # (prompt, sample) in the order they were drawn
    m = json.loads(monitors.read_text(encoding="utf-8"))
    assert sorted(m) == ["1", "2", "4", "speed"]
    # the run's arithmetic: the sampling and the RM's scores of the answers, each counted apart
    assert sorted(m["speed"]["flops"]) == ["forward", "sample"] and m["speed"]["matmul_flop_s"] > 0
    assert m["4"]["rm_score"] == pytest.approx(sum(r["score"] for r in rows) / 2)
    for k in (1, 2, 4):
        assert m[str(k)]["rm_score"] == pytest.approx(sum(max(p[:k]) for p in per_prompt) / 2, abs=1e-4)
        assert m[str(k)]["best_of_n"] == k and m[str(k)]["kl_bound"] == pytest.approx(math.log(k) - (k - 1) / k)
    assert 0 <= m["4"]["judge"] <= 1 and 0 <= m["4"]["eos_share"] <= 1 and 0 < m["4"]["length"] <= 6
    code, _, err = cli(capsys, "--checkpoint", ckpts["sft"], "--prompt", "x", "--monitors", monitors)
    assert code == 2 and "--monitors needs --prompts_file and --reward" in err


def test_prompts_file_text_and_jsonl(capsys, tmp_path, ckpts, policy, tokenizer):
    prompts = ["中国的首都", "写一条好评：", "hello world"]
    expected = [decode(greedy(policy, chat_prompt_ids(p, tokenizer), 6), tokenizer) for p in prompts]

    text_file = tmp_path / "prompts.txt"
    text_file.write_text(f"{prompts[0]}\n\n{prompts[1]}\n   \n{prompts[2]}\n", encoding="utf-8")
    code, out, err = cli(capsys, "--checkpoint", ckpts["sft"], "--prompts_file", text_file, "--temperature", 0,
                         "--max_new_tokens", 6)
    assert code == 0 and f"skipped 2 blank line(s) of {text_file}; one answer per non-blank line" in err
    assert [json.loads(line) for line in out.splitlines()] == [
        {"prompt": p, "response": r} for p, r in zip(prompts, expected)]

    jsonl_file, output = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    jsonl_file.write_text("".join(json.dumps({"prompt": p, "id": i}, ensure_ascii=False) + "\n"
                                  for i, p in enumerate(prompts)), encoding="utf-8")
    code, out, err = cli(capsys, "--checkpoint", ckpts["sft"], "--prompts_file", jsonl_file, "--output", output,
                         "--temperature", 0, "--max_new_tokens", 6)
    assert code == 0 and out == ""
    assert output.read_text(encoding="utf-8").splitlines() == [
        json.dumps({"prompt": p, "response": r}, ensure_ascii=False) for p, r in zip(prompts, expected)]
    output.write_text("keep me\n", encoding="utf-8")  # an existing file is kept unless --overwrite is given
    code, _, err = cli(capsys, "--checkpoint", ckpts["sft"], "--prompts_file", jsonl_file, "--output", output)
    assert code == 2 and "--overwrite" in err and output.read_text(encoding="utf-8") == "keep me\n"
    code, _, _ = cli(capsys, "--checkpoint", ckpts["sft"], "--prompts_file", jsonl_file, "--output", output,
                     "--overwrite", "--temperature", 0, "--max_new_tokens", 6)
    assert code == 0 and len(output.read_text(encoding="utf-8").splitlines()) == len(prompts)


def test_prompts_file_takes_the_alignment_stages_records(capsys, tmp_path, ckpts, policy, tokenizer):
    """generate.py reads prompt records as 3-PPO.py does: an alpaca record answers as its plain prompt, a
    conversation is laid out by chat_messages_ids (greedy tokens compared with the reference loop)."""
    from chinese_tokenizer import chat_messages_ids

    turns = [("user", "你好"), ("assistant", "你好！"), ("user", PROMPT)]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"instruction": PROMPT}, ensure_ascii=False) + "\n" + json.dumps(
        {"messages": [{"role": r, "content": c} for r, c in turns]}, ensure_ascii=False) + "\n", encoding="utf-8")
    code, out, _ = cli(capsys, "--checkpoint", ckpts["sft"], "--prompts_file", path, "--temperature", 0,
                       "--max_new_tokens", 6)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and rows[0]["response"] == decode(greedy(policy, chat_prompt_ids(PROMPT, tokenizer), 6),
                                                        tokenizer)
    assert rows[1]["response"] == decode(greedy(policy, chat_messages_ids(turns, tokenizer), 6), tokenizer)
    code, out, err = cli(capsys, "--checkpoint", ckpts["pretrain"], "--prompts_file", path)
    assert code == 2 and "needs a chat checkpoint" in err and out == ""  # refused before the first answer


def test_file_answer_equals_single_prompt_answer(capsys, tmp_path, ckpts):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"别的问题\n{PROMPT}\n", encoding="utf-8")
    args = ("--checkpoint", ckpts["sft"], "--temperature", 1.0, "--max_new_tokens", 10, "--seed", 5)
    _, out, _ = cli(capsys, *args, "--prompts_file", prompts)
    rows = [json.loads(line) for line in out.splitlines()]
    assert cli(capsys, *args, "--prompt", PROMPT)[1] == rows[1]["response"] + "\n"


def test_prompts_of_a_file_do_not_share_their_random_draws(capsys, tmp_path, tokenizer):
    """A model that ignores its prompt (all weights 0: uniform next-token probabilities) shows the draws alone: if
    every prompt restarted the generator from --seed, both prompts would get the same tokens."""
    blank = GPTModel(TINY)
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
    save_checkpoint(str(tmp_path / "blank"), blank, tokenizer, {"stage": "sft"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("第一个问题\n第二个问题\n", encoding="utf-8")
    args = ("--checkpoint", tmp_path / "blank", "--temperature", 1.0, "--max_new_tokens", 12, "--seed", 5)
    _, out, _ = cli(capsys, *args, "--prompts_file", prompts)
    first, second = (json.loads(line)["response"] for line in out.splitlines())
    assert first and second and first != second
    assert cli(capsys, *args, "--prompt", "第二个问题")[1] == second + "\n"  # still the answer it gets alone
    assert gen.prompt_seed(5, "第二个问题") == gen.prompt_seed(5, "第二个问题") != gen.prompt_seed(6, "第二个问题")


def test_interactive_loop_streams_answers(capsys, monkeypatch, ckpts, policy, tokenizer):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\n\n   \nhello world\nexit\n中国\n"))
    code, out, err = cli(capsys, "--checkpoint", ckpts["sft"], "--temperature", 0, "--max_new_tokens", 7)
    assert code == 0
    expected = [decode(greedy(policy, chat_prompt_ids(p, tokenizer), 7), tokenizer) for p in (PROMPT, "hello world")]
    assert out == "".join(e + "\n" for e in expected)  # blank lines skipped, nothing read after "exit"
    assert "exit" in err


def test_interactive_loop_ends_at_eof(capsys, monkeypatch, ckpts, policy, tokenizer):
    monkeypatch.setattr(sys, "stdin", io.StringIO("中国"))  # no newline, then EOF
    code, out, _ = cli(capsys, "--checkpoint", ckpts["pretrain"], "--temperature", 0, "--max_new_tokens", 4)
    assert code == 0 and out == decode(greedy(policy, encode("中国", tokenizer), 4), tokenizer) + "\n"


def test_text_stream_writes_each_token_as_it_arrives(tokenizer):
    class Recorder:
        def __init__(self):
            self.parts = []

        def write(self, text):
            self.parts.append(text)

        def flush(self):
            pass

    text = "你好，playing世界\n再见"
    ids = encode(text, tokenizer)
    assert any(tokenizer.convert_ids_to_tokens(i).startswith("##") for i in ids)  # a word piece is in there
    out = Recorder()
    stream = gen.TextStream(tokenizer, out)
    for token in ids + [SEP_ID, 345, 678]:  # tokens after [SEP] are filler from finished rows
        stream(torch.tensor([token]))
    assert "".join(out.parts) == text
    assert len(out.parts) == len(ids)  # one write per token, none after [SEP]


def test_default_checkpoint_is_the_latest_stage(capsys, monkeypatch, tmp_path, ckpts, policy, tokenizer):
    stages = [str(tmp_path / "ppo"), ckpts["sft"], ckpts["pretrain"]]  # no PPO checkpoint yet
    monkeypatch.setattr(inference, "STAGE_DIRS", stages)
    code, out, err = cli(capsys, "--prompt", PROMPT, "--temperature", 0, "--max_new_tokens", 5)
    assert code == 0 and f"using {ckpts['sft']}" in err
    assert out == decode(greedy(policy, chat_prompt_ids(PROMPT, tokenizer), 5), tokenizer) + "\n"

    monkeypatch.setattr(inference, "STAGE_DIRS", [str(tmp_path / "ppo"), str(tmp_path / "sft")])
    code, out, err = cli(capsys, "--prompt", PROMPT)
    assert code == 2 and "no checkpoint in" in err and "--checkpoint" in err


@pytest.mark.parametrize("argv, words", [
    (["--prompt", ""], ["--prompt", "empty"]),
    (["--prompt", " \n\t "], ["--prompt", "empty"]),
    (["--prompt", "x", "--checkpoint", "{root}/missing"], ["--checkpoint", "missing", "does not exist"]),
    (["--prompt", "x", "--checkpoint", "{sft}/config.json"], ["--checkpoint", "is a file", "give its folder"]),
    (["--prompt", "x", "--checkpoint", "{root}"], ["no checkpoint at", "config.json"]),
    (["--prompt", "x", "--checkpoint", "{rm}"], ["reward model", "--reward"]),
    (["--prompt", "x", "--checkpoint", "{sft}", "--reward", "{sft}"], ["reward model is needed", "2-RM.py"]),
    (["--prompt", "x", "--checkpoint", "{sft}", "--reward", "{root}/none"], ["--reward", "does not exist"]),
    (["--prompt", "x", "--from_hf", "{root}/none"], ["--from_hf", "not a directory"]),
    (["--prompts_file", "{root}/none.txt", "--checkpoint", "{sft}"], ["--prompts_file", "none.txt", "not found"]),
    (["--prompts_file", "{root}/bad.jsonl", "--checkpoint", "{sft}"], ["bad.jsonl", "line 2", "prompt"]),
    (["--prompts_file", "{root}/blank.txt", "--checkpoint", "{sft}"], ["blank.txt", "no prompt"]),
    (["--prompt", "x", "--output", "a.jsonl"], ["--output", "--prompts_file"]),
    (["--prompt", "x", "--checkpoint", "{sft}", "--device", "toaster"], ["--device", "cpu"]),
    (["--prompt", "x", "--checkpoint", "{sft}", "--temperature", "inf"], ["--temperature", "finite"]),
    (["--prompts_file", "{root}/ok.txt", "--output", "{root}/no/such/dir/out.jsonl"], ["--output", "create it"]),
    (["--prompts_file", "{root}/ok.txt", "--output", "{root}/blank.txt"],
     ["--output", "already exists", "--overwrite"]),
    (["--prompts_file", "{root}/ok.txt", "--output", "{root}/ok.txt", "--overwrite"], ["--prompts_file itself"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, ckpts, argv, words):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "好"}\n{"text": "no prompt here"}\n', encoding="utf-8")
    (tmp_path / "blank.txt").write_text("\n  \n\n", encoding="utf-8")
    (tmp_path / "ok.txt").write_text("你好\n", encoding="utf-8")
    argv = [a.format(root=tmp_path, rm=ckpts["rm"], sft=ckpts["sft"]) for a in argv]
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    for word in words:
        assert word in err


def test_command_line_errors_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "generate.py", "--checkpoint", str(tmp_path / "nothing"), "--prompt",
                           "你好"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: --checkpoint {tmp_path / 'nothing'} does not exist; give a directory written by a stage script"]


def test_from_hf_loads_through_load_weight(capsys, tmp_path, policy, tokenizer):
    if not (REPO_ROOT / "load_weight.py").is_file():
        pytest.skip("load_weight.py is not in the repository yet, so --from_hf cannot be exercised")
    import load_weight

    load_weight.save_hf_model(policy, str(tmp_path / "hf"))
    code, out, err = cli(capsys, "--from_hf", tmp_path / "hf", "--prompt", PROMPT, "--temperature", 0,
                         "--max_new_tokens", 8)
    assert code == 0 and "plain continuation" in err  # exported without the chat template
    # the export records whether prompts start with [CLS] (uer's weights do; a model of ours keeps its bos_id)
    start = [policy.cfg.bos_id] if policy.cfg.bos_id is not None else []
    assert out == decode(greedy(policy, start + encode(PROMPT, tokenizer), 8), tokenizer) + "\n"
    long_prompt = PROMPT * CONTEXT
    ids = inference.prompt_to_ids(long_prompt, tokenizer, False, CONTEXT, CLS_ID)  # cut from the left, [CLS] kept
    assert len(ids) == CONTEXT and ids == [CLS_ID] + encode(long_prompt, tokenizer)[-(CONTEXT - 1):]
