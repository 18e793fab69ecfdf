"""The curves in TensorBoard (``--report_to``, ``training.Curves``): the event files hold what metrics.jsonl holds,
every number at its row's step once, a run that died after its last save and was resumed included."""

import json
import math
import types

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import load_script, run_script
from plumbing import training
from plumbing.training import CURVES_DIR, Curves, StageRun


def event_scalars(folder) -> dict:
    """{tag: [(step, value), ...]} of every scalar in the event files of ``folder``, in the order written."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event, none sampled
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def metrics_scalars(path) -> dict:
    """The same from metrics.jsonl: every number but ``step``, at its row's step, as float32 (what an event holds)."""
    curves = {}
    for line in open(path, encoding="utf-8"):
        row = json.loads(line)
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                curves.setdefault(k, []).append((row["step"], float(np.float32(v))))
    return curves


def same_curves(events: dict, metrics: dict) -> bool:
    """Equal tags, steps and float32 values (NaN equal to NaN)."""
    if events.keys() != metrics.keys():
        return False
    return all(len(events[k]) == len(metrics[k]) and all(
        s == t and (v == w or (math.isnan(v) and math.isnan(w))) for (s, v), (t, w) in zip(events[k], metrics[k]))
        for k in events)


class FakeAccelerator:
    """What ``Curves`` asks of an ``Accelerator``: the calls are recorded."""

    is_main_process = True

    def __init__(self):
        self.logged, self.trackers = [], []

    def wait_for_everyone(self):
        pass

    def init_trackers(self, name, init_kwargs=None):
        self.project, self.init_kwargs = name, init_kwargs

    def log(self, values, step):
        self.logged.append((step, dict(values)))


def test_curves_send_each_number_once_and_values_added_to_a_row_later(tmp_path):
    """Rows added since the last send go out; a value added to a row already sent goes out alone, at that row's
    step; strings and bools do not (TensorBoard's scalars are numbers)."""
    accelerator = FakeAccelerator()
    args = types.SimpleNamespace(report_to="tensorboard", output_dir=str(tmp_path))
    rows = [{"step": 0, "val_loss": 9.9, "note": "x"}]
    curves = Curves(accelerator, args, rows)
    assert accelerator.project == CURVES_DIR and accelerator.logged == [(0, {"val_loss": 9.9})]
    rows.append({"step": 1, "train_loss": 5.0, "lr": 1e-3, "flag": True})
    curves.send(rows)
    curves.send(rows)  # nothing new: nothing logged
    rows[-1]["val_judge"] = 0.5  # the final monitors join the last row after it was logged
    curves.send(rows)
    assert accelerator.logged == [(0, {"val_loss": 9.9}), (1, {"train_loss": 5.0, "lr": 1e-3}), (1, {"val_judge": 0.5})]


def test_report_to_none_logs_nothing_and_drops_an_earlier_runs_curves(tmp_path):
    """A run with --report_to none (after --overwrite or with --resume) leaves no curves of an earlier run in its
    folder to be carried into its checkpoint; files that are not event files stay."""
    folder = tmp_path / CURVES_DIR
    folder.mkdir()
    (folder / "events.out.tfevents.1.vm.1.0").write_bytes(b"old curves")
    accelerator = FakeAccelerator()
    args = types.SimpleNamespace(report_to="none", output_dir=str(tmp_path))
    curves = Curves(accelerator, args, [{"step": 0, "a": 1}])
    curves.send([{"step": 0, "a": 1}])
    assert accelerator.logged == [] and not folder.exists()
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "events.out.tfevents.2.vm.1.0").write_bytes(b"old curves")
    Curves(accelerator, args, [])
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


def test_wandb_and_trackio_log_each_stage_as_a_run_of_one_project(tmp_path):
    accelerator = FakeAccelerator()
    Curves(accelerator, types.SimpleNamespace(report_to="wandb", output_dir=str(tmp_path)), [], "sft")
    assert accelerator.project == training.TRACKER_PROJECT and accelerator.init_kwargs == {"wandb": {"name": "sft"}}


def test_a_missing_tracker_package_is_one_line(monkeypatch):
    monkeypatch.setattr(training.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(training.UserError, match=r"--report_to wandb: the wandb package is not installed.*none"):
        training.tracker_of(types.SimpleNamespace(report_to="wandb"))


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_of_a_run_that_died_after_its_last_save_and_was_resumed(tmp_path, tiny_corpus,
                                                                                             monkeypatch):
    """A pretraining run saves at step 2 (--save_every 2), logs step 3 and dies: its event files (in the checkpoint
    folder, carried through the save) hold step 3, its checkpoint does not. --resume continues from step 2; at the
    end the event files hold exactly what metrics.jsonl holds: every value once, steps 0-6, step 3 the resumed
    run's."""
    out = tmp_path / "pretrain"
    argv = ["--preset", "tiny", "--train_files", str(tiny_corpus / "train.txt"), "--val_files",
            str(tiny_corpus / "val.txt"), "--output_dir", str(out), "--max_steps", "6", "--eval_every", "2",
            "--save_every", "2"]
    log = StageRun.log

    def log_then_die_at_step_3(self, row, show=()):
        logged = log(self, row, show)
        if self.step == 3:
            raise RuntimeError("the power went out")
        return logged

    monkeypatch.setattr(StageRun, "log", log_then_die_at_step_3)
    with pytest.raises(RuntimeError, match="power"):
        load_script("0-PRETRAIN.py").main(argv)
    monkeypatch.undo()
    died = event_scalars(out / CURVES_DIR)
    assert [s for s, _ in died["train_loss"]] == [1, 2, 3]  # step 3 was logged before the power went out
    saved = metrics_scalars(out / "metrics.jsonl")
    assert [s for s, _ in saved["train_loss"]] == [1, 2]  # the checkpoint ends at step 2

    result = run_script("0-PRETRAIN.py", *argv, "--resume")
    assert result.returncode == 0, result.stderr[-1500:]
    events, metrics = event_scalars(out / CURVES_DIR), metrics_scalars(out / "metrics.jsonl")
    assert [s for s, _ in events["train_loss"]] == [1, 2, 3, 4, 5, 6]  # none missing, none twice
    assert same_curves(events, metrics)
    assert {"val_loss", "lr", "tokens_seen"} <= events.keys()
