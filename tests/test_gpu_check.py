"""bench/gpu_check.py, the device check, run as its --dry_run: every step at tiny size on the CPU, so that the check
a GPU machine runs once is known to work before it gets there."""

import json
import math
import sys

import pytest

from conftest import REPO_ROOT, run_script


@pytest.mark.slow
def test_the_device_check_runs_every_step_at_tiny_size(tmp_path):
    # asked when the test runs, not when it is collected: on a fresh clone make test's data tests build data/ first
    if not (REPO_ROOT / "data" / "MANIFEST.json").is_file():
        pytest.skip("the check's pipeline step needs data/ (python data/prepare.py; make test builds it)")
    result = run_script("bench/gpu_check.py", "--dry_run", "--out", tmp_path, timeout=900,
                        env={"OMP_NUM_THREADS": None})
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "table.md").read_text(encoding="utf-8")
    assert "failed" not in table and "did not finish" not in table, table
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    for compiled in (False, True):
        run = results[f"pretrain_compile_{compiled}"]
        assert run["batch"] == 4 and run["tokens_per_s"] > 0 and run["mfu"] is None  # a CPU has no peak
    summary = results["cuda_tests"]["summary"]
    assert "failed" not in summary and "error" not in summary and ("skipped" in summary or "passed" in summary)
    assert results["pipeline"]["exit"] == 0 and (tmp_path / "report.md").is_file()
    # a decode step is the difference of two timings: finite, but on a loaded machine it may come out <= 0
    assert all(math.isfinite(v["step_s"]) and v["bound_s"] > 0 for k, v in results.items() if k.startswith("decode_"))
    assert table in result.stdout  # the table is printed too


def test_without_a_gpu_the_check_says_to_use_the_dry_run():
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    result = run_script("bench/gpu_check.py")
    assert result.returncode == 2 and "--dry_run" in result.stderr and len(result.stderr.strip().splitlines()) == 1
