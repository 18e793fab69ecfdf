"""Reliability and safety across stages: interruption, atomic and pickle-free checkpoints, and bad input that must
end in one line on stderr, exit code 2, and nothing written or lost."""

import errno
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO_ROOT, run_script
from gpt_model import GPTModel, get_preset
from plumbing.checkpoint import load_checkpoint, load_pickle_free, load_weights_into, save_checkpoint
from plumbing.cli import UserError
from plumbing.documents import load_text_documents
from plumbing.records import read_jsonl


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def one_line_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr[-1500:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr[-1500:]
    for needle in needles:
        assert needle in lines[0]


# --- interruption ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_saves_a_resumable_state_and_resume_finishes(tmp_path, tiny_corpus):
    """SIGINT mid-run: the step finishes, state/ is saved, the exit code is 130 with a --resume hint; --resume then
    completes the run. The signal is sent once the run has written its step-3 checkpoint (--save_every 3): a file
    the stage writes by design, whatever the machine's speed and however the progress bar looks."""
    out = tmp_path / "run"
    args = [sys.executable, "0-PRETRAIN.py", "--preset", "tiny", "--max_steps", "400", "--eval_every", "400",
            "--save_every", "3", "--train_files", str(tiny_corpus / "train.txt"),
            "--val_files", str(tiny_corpus / "val.txt"), "--output_dir", str(out)]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = out / "state" / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not state.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 3"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT
    assert "--resume" in stdout
    stopped_at = int(re.search(r"interrupted at step (\d+)", stdout).group(1))
    assert stopped_at >= 3 and json.loads(state.read_text())["trainer"]["step"] == stopped_at  # saved at the signal
    assert (out / "model.safetensors").exists()
    result = run_script(*args[1:], "--resume")
    assert result.returncode == 0, result.stderr[-1500:]
    assert not (out / "state").exists()


# --- checkpoints: atomic, never silently replaced, never unpickled ----------------------------------------------

def tiny_model(**changes):
    torch.manual_seed(0)
    return GPTModel(get_preset("tiny").replace(**changes))


def test_disk_full_while_saving_keeps_the_old_checkpoint(tmp_path, tokenizer):
    """ENOSPC halfway through a save: a one-line UserError, the previous checkpoint byte-identical, no temp dir."""
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "pretrain", "step": 1})
    before = snapshot(out)

    def disk_full(state_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError, match="No space left on device"):
        save_checkpoint(str(out), tiny_model(n_layers=1), tokenizer, {"stage": "pretrain", "step": 2}, disk_full)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path, tokenizer):
    """A KeyboardInterrupt during a write (the closest a test gets to a kill) leaves the old checkpoint in place."""
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "pretrain"})
    before = snapshot(out)

    def interrupted(state_dir):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "pretrain"}, interrupted)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class RunsCode:
    """Unpickling this would create the marker file: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "pytorch_model.bin"
    with open(path, "wb") as f:
        pickle.dump({"weight": RunsCode(str(marker))}, f)
    with pytest.raises(UserError, match="refusing to load"):
        load_pickle_free(str(path))
    assert not marker.exists()
    torch.save({"weight": torch.ones(2)}, tmp_path / "plain.bin")  # plain tensors still load
    assert torch.equal(load_pickle_free(str(tmp_path / "plain.bin"))["weight"], torch.ones(2))


def test_weights_file_replaced_by_a_pickle_is_refused(tmp_path, tokenizer):
    """Checkpoints are read with safetensors only: a pickle in model.safetensors is an error, never executed."""
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "pretrain"})
    marker = tmp_path / "pwned"
    with open(out / "model.safetensors", "wb") as f:
        pickle.dump(RunsCode(str(marker)), f)
    with pytest.raises(UserError, match="model.safetensors"):
        load_checkpoint(str(out))
    assert not marker.exists()


def test_checkpoint_files_follow_the_umask(tmp_path, tokenizer):
    """The checkpoint is written in a private temporary directory by safetensors (0600 files), yet the result has
    the modes the user's umask gives new files and directories."""
    out = tmp_path / "ckpt"
    old = os.umask(0o027)
    try:
        save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "pretrain"})
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o750
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert modes["model.safetensors"] == modes["config.json"] == 0o640 and modes["tokenizer"] == 0o750
    assert set(modes.values()) == {0o640, 0o750}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing torch._dynamo warns about torch.jit
def test_compiled_model_saves_and_generates_as_the_module_inside(tmp_path, tokenizer):
    """`accelerate launch --dynamo_backend inductor` hands the stages a torch.compile wrapper: saving it writes the
    plain model, and generate runs the module inside instead of compiling a graph per sequence length."""
    from torch._dynamo.utils import counters

    from gpt_model import generate

    model = tiny_model().eval()
    compiled = torch.compile(model)  # lazy: nothing is compiled until it is called
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), compiled, tokenizer, {"stage": "pretrain"})
    loaded, _, config = load_checkpoint(str(out))
    assert config["model_type"] == "gpt"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    frames = counters["frames"]["total"]
    prompt = torch.tensor([[5, 6, 7]])
    assert torch.equal(generate(compiled, prompt, 5, 64), generate(model, prompt, 5, 64))
    assert counters["frames"]["total"] == frames  # no frame went through the compiler


def test_checkpoint_whose_tokenizer_does_not_fit_its_model(tmp_path, tokenizer):
    """A model with 61 embedding rows saved beside the 21128-id tokenizer is refused on load, naming both sizes."""
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), tiny_model(vocab_size=61), tokenizer, {"stage": "pretrain"})
    with pytest.raises(UserError, match=r"ckpt: the tokenizer has 21128 ids but the model's vocab_size is 61; "
                                        r"the checkpoint is inconsistent"):
        load_checkpoint(str(out))


def test_checkpoint_from_another_vocab_or_architecture(tmp_path, tokenizer):
    """Loading into the wrong vocabulary or shape fails with one message naming both sides."""
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "pretrain"})
    with pytest.raises(UserError, match="vocab_size 21128 but this run uses 50257"):
        load_checkpoint(str(out), expect_vocab_size=50257)
    with pytest.raises(UserError, match=r"n_layers.*\(2, 3\)"):
        load_weights_into(tiny_model(n_layers=3), str(out))
    config = (out / "config.json").read_text(encoding="utf-8").replace('"emb_dim": 32', '"emb_dim": 64')
    (out / "config.json").write_text(config, encoding="utf-8")
    with pytest.raises(UserError, match="does not fit its config"):
        load_checkpoint(str(out))


def test_reward_checkpoint_required_where_a_reward_model_is_needed(tmp_path, tokenizer):
    out = tmp_path / "ckpt"
    save_checkpoint(str(out), tiny_model(), tokenizer, {"stage": "sft"})
    with pytest.raises(UserError, match="reward model is needed"):
        load_checkpoint(str(out), "reward")
    with pytest.raises(UserError, match=r"^--reward \S+ is a language model, but a reward model is needed"):
        load_checkpoint(str(out), "reward", flag="--reward")  # the aligners' --reward, generate.py's --reward


def test_a_stage_names_the_flag_of_a_checkpoint_of_the_wrong_kind(tmp_path, tokenizer):
    """--init of the SFT stage given a reward model, through the stages' load_backbone."""
    from gpt_model import RewardModel
    from plumbing.checkpoint import load_backbone
    out = tmp_path / "rm"
    save_checkpoint(str(out), RewardModel(tiny_model().cfg), tokenizer, {"stage": "rm"})
    with pytest.raises(UserError, match=r"^--init \S+ is a reward model, but a language model is needed"):
        load_backbone(str(out), "--init", tokenizer, "0-PRETRAIN.py")


def test_a_reward_model_is_not_a_language_model(tmp_path, tokenizer):
    """A PPO --policy or an export needs a language model: a reward checkpoint is refused, while its backbone can
    still initialise another stage (load_weights_into)."""
    from gpt_model import RewardModel

    out = tmp_path / "rm"
    torch.manual_seed(0)
    rm = RewardModel(get_preset("tiny"))
    save_checkpoint(str(out), rm, tokenizer, {"stage": "rm"})
    with pytest.raises(UserError, match="is a reward model"):
        load_checkpoint(str(out), "gpt")
    model = tiny_model()
    load_weights_into(model, str(out))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), rm.backbone.state_dict().values()))


# --- bad data files -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b'{"text": "\xff\xfe bad"}\n', "not UTF-8"),
    (b'{"prompt": "hi"}\n', "field 'response' is missing"),
    (b'{"prompt": "hi", "response": 3}\n', "field 'response' is not a non-empty string (int)"),
    (b'{"prompt": "hi", "response": "   "}\n', "field 'response' is not a non-empty string"),
    (b'{"prompt": "hi", "response": "ok"}\n{"prompt": \n', "line 2 is not valid JSON"),
    (b'["prompt", "response"]\n', "not a JSON object"),
    (b"\n\n", "holds no rows"),
])
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        if content:
            read_jsonl(str(path), ("prompt", "response"))
        else:
            list(load_text_documents([str(path)], "--train_files"))  # read as it is iterated
    assert message in str(info.value) and "pairs.jsonl" in str(info.value)
    assert "\n" not in str(info.value)


def test_non_utf8_text_file(tmp_path):
    (tmp_path / "gbk.txt").write_bytes("中文".encode("gbk"))
    with pytest.raises(UserError, match="gbk.txt is not UTF-8"):
        list(load_text_documents([str(tmp_path / "gbk.txt")], "--train_files"))


# --- bad command lines: one line, exit 2, nothing written ---------------------------------------------------------

@pytest.mark.parametrize("extra, needle", [
    (["--batch_size", "0"], "--batch_size"),
    (["--learning_rate", "-0.1"], "--learning_rate"),
    (["--learning_rate", "inf"], "--learning_rate"),
    (["--context_length", "999"], "--context_length 999"),
    (["--preset", "huge"], "--preset"),
    (["--train_files", "missing/*.txt"], "missing/*.txt"),
    (["--max_step", "3"], "unrecognized arguments: --max_step 3"),  # no prefix matching of --max_steps
])
def test_impossible_settings_stop_before_anything_is_written(tmp_path, tiny_corpus, extra, needle):
    out = tmp_path / "out"
    base = ["--preset", "tiny", "--train_files", tiny_corpus / "train.txt", "--val_files", tiny_corpus / "val.txt",
            "--output_dir", out]
    result = run_script("0-PRETRAIN.py", *base, *extra)
    one_line_error(result, needle)
    assert not out.exists()


def test_overwrite_and_resume_messages_offer_what_the_folder_allows(tmp_path):
    """A finished checkpoint: the refusal offers --overwrite, not --resume, and --resume on it says to use
    --overwrite; a folder with a saved state offers --resume."""
    from plumbing.checkpoint import check_output_dir

    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(UserError) as refused:
        check_output_dir(str(tmp_path), overwrite=False, resume=False)
    assert "--overwrite" in str(refused.value) and "--resume" not in str(refused.value)
    with pytest.raises(UserError, match="finished checkpoint: pass --overwrite instead"):
        check_output_dir(str(tmp_path), overwrite=False, resume=True)
    (tmp_path / "state").mkdir()
    with pytest.raises(UserError, match="--resume to continue its saved state"):
        check_output_dir(str(tmp_path), overwrite=False, resume=False)
    check_output_dir(str(tmp_path), overwrite=False, resume=True)


def test_resume_without_a_saved_state(tmp_path, tiny_corpus):
    result = run_script("0-PRETRAIN.py", "--preset", "tiny", "--output_dir", tmp_path / "none", "--resume",
                        "--train_files", tiny_corpus / "train.txt", "--val_files", tiny_corpus / "val.txt")
    one_line_error(result, "--resume")
