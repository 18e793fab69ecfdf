"""The shared stage plumbing (``training.StageRun``) and the precision it runs in.

* A non-finite loss on one process of two must stop both with the same one-line error: a check made on one process
  alone leaves the other waiting forever in the next collective.
* The default precision is bf16 exactly where the hardware computes it natively (``devices.pick_mixed_precision``).
(The shape of the import graph is checked in tests/test_layout.py.)
"""

import json
import subprocess

import pytest

from conftest import REPO_ROOT, run_script

# Runs a stage script as __main__ after making the loss NaN on the process of rank 1 only (from its first step).
# Each process records its exit code and its stderr in rank<N>.json, then waits at a barrier so that neither is
# killed by the launcher before the other has written (the launcher ends the others once one process fails).
NAN_ON_RANK_1 = """
import io, json, os, runpy, sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import gpt_model

real_forward = gpt_model.GPTModel.forward


def forward(self, *args, **kwargs):
    out = real_forward(self, *args, **kwargs)
    if "loss" in out and self.training and os.environ.get("RANK") == "1":
        out["loss"] = out["loss"] * float("nan")
    return out


class Tee(io.StringIO):
    def write(self, text):
        sys.__stderr__.write(text)
        return super().write(text)


gpt_model.GPTModel.forward = forward
sys.stderr = Tee()
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{"code": code, "stderr": sys.stderr.getvalue()}}, f)
if dist.is_initialized():
    dist.barrier()
sys.exit(code)
"""


@pytest.mark.slow
def test_a_nan_loss_on_one_process_stops_every_process_with_one_error(tmp_path, tiny_pretrain_checkpoint):
    pairs = [{"prompt": f"问题{i}", "response": f"回答{i}。"} for i in range(16)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    wrapper = tmp_path / "nan_on_rank_1.py"
    wrapper.write_text(NAN_ON_RANK_1.format(repo=str(REPO_ROOT), out=str(tmp_path)), encoding="utf-8")
    try:
        result = run_script("-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                            wrapper, REPO_ROOT / "1-SFT.py", "--preset", "tiny", "--init", tiny_pretrain_checkpoint,
                            "--train_files", data, "--val_files", data, "--output_dir", tmp_path / "sft",
                            "--max_steps", "4", "--batch_size", "2", timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("the processes hung after one of them saw a NaN loss")
    assert result.returncode != 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in (0, 1)]
    errors = []
    for rank in ranks:
        assert rank["code"] == 2, result.stderr[-3000:]
        assert "Traceback" not in rank["stderr"]
        errors.append(rank["stderr"][rank["stderr"].index("error: "):])  # after the progress bar's \r, if any
        assert errors[-1].startswith("error: the training loss became nan at step 1;")  # one line ...
        assert errors[-1].count("\n") == 1
    assert errors[0] == errors[1]  # ... and the same on both processes
    # no checkpoint: the folder holds only the curves the run logged before it stopped (--report_to tensorboard)
    assert [p.name for p in (tmp_path / "sft").iterdir()] == ["tensorboard"]


def test_mixed_precision_choice(monkeypatch):
    from plumbing import devices as training

    monkeypatch.setattr(training, "native_bf16", lambda: True)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert training.pick_mixed_precision("auto") == "bf16"  # plain python on a CPU with AMX / AVX512-BF16
    assert training.pick_mixed_precision("no") == "no"  # the flag wins
    monkeypatch.setattr(training, "native_bf16", lambda: False)
    assert training.pick_mixed_precision("auto") == "no"  # emulated bf16 would be slower than fp32
    assert training.pick_mixed_precision("bf16") == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate launch` was given
    assert training.pick_mixed_precision("auto") == "fp16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setattr(training, "native_bf16", lambda: True)
    assert training.pick_mixed_precision("auto") == "no"


def test_native_bf16_reads_the_cpu_flags():
    from plumbing import devices as training

    flags = next((line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("flags")), "")
    expected = any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))
    assert training.native_bf16() == expected


@pytest.mark.slow
def test_a_plain_run_records_its_precision(tmp_path, tiny_corpus):
    """Run with plain python (no `accelerate launch`), the stage autocasts to bf16 exactly where the CPU computes
    bf16 natively, and config.json says which precision was used."""
    from plumbing import devices as training

    result = run_script("0-PRETRAIN.py", "--preset", "tiny", "--max_steps", "2", "--eval_every", "2",
                        "--train_files", tiny_corpus / "train.txt", "--val_files", tiny_corpus / "val.txt",
                        "--output_dir", tmp_path / "pt", env={"ACCELERATE_MIXED_PRECISION": None})
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((tmp_path / "pt" / "config.json").read_text(encoding="utf-8"))
    assert config["mixed_precision"] == ("bf16" if training.native_bf16() else "no")


def run_steps(tmp_path, micro_batches, gradient_accumulation_steps, max_grad_norm=100.0):
    """Two optimizer steps of the loop every stage writes (``stage.accumulate()``, ``accelerator.backward``,
    ``stage.clip_gradients()``, ``optimizer.step()``, ``optimizer.zero_grad()``) on a linear model, SGD at rate 1,
    the rows of ``micro_batches`` (a list of (x, y)) taken ``gradient_accumulation_steps`` at a time. Returns the
    weights after each step."""
    import types

    import torch
    from accelerate import Accelerator

    from plumbing.training import StageRun

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    args = types.SimpleNamespace(output_dir=str(tmp_path), resume=False, max_steps=2, stop_after=None,
                                 save_every=None, eval_every=2, max_grad_norm=max_grad_norm, learning_rate=1.0,
                                 warmup_steps=0)
    stage = StageRun("test", args, accelerator, model, optimizer, None, {}, plot=("c.png", []))
    weights, batches = [], iter(micro_batches)
    for _ in stage.steps():
        for _ in range(gradient_accumulation_steps):
            x, y = next(batches)
            with stage.accumulate():
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        if stage.clip_gradients():
            optimizer.step()
        optimizer.zero_grad()
        stage.end_step(0.0)
        weights.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
    return weights


def test_accumulated_micro_batches_make_the_step_of_the_whole_batch(tmp_path):
    """Two micro-batches of 2 with --gradient_accumulation_steps 2 move the weights as one batch of 4 does (the loss
    divided by the micro-batch count once, one optimizer step per step); and the gradient norm is clipped to
    --max_grad_norm: with SGD at rate 1 the step's length is the clipped norm."""
    import torch

    torch.manual_seed(1)
    x, y = torch.randn(8, 3), torch.randn(8, 1) * 10
    whole = run_steps(tmp_path / "a", [(x[:4], y[:4]), (x[4:], y[4:])], 1)
    accumulated = run_steps(tmp_path / "b", [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)], 2)
    for a, b in zip(whole, accumulated):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    start = run_steps(tmp_path / "c", [(x[:4], y[:4])] * 2, 1, max_grad_norm=0.5)
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in torch.nn.Linear(3, 1).parameters()])
    assert (start[0] - initial).norm().item() == pytest.approx(0.5, rel=1e-5)  # the norm was far above 0.5
