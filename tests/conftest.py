"""Shared pytest setup: the repository root on ``sys.path``, the ``slow`` and ``cuda`` markers, a ``tokenizer``
fixture and ``quiet_single_thread`` for modules of tiny models compared with transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# The tests compare the stages with fp32 oracles and thresholds: run every stage in fp32, as `accelerate launch
# --mixed_precision no` would (subprocesses inherit it). test_pretrain checks the default (bf16 where native) itself.
os.environ["ACCELERATE_MIXED_PRECISION"] = "no"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s; still run by CI")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped, with the reason, where there is none")


@pytest.fixture(scope="module")
def quiet_single_thread():
    """For modules of tiny models compared with transformers: one intra-op thread is faster on a busy 2-core box,
    and transformers' progress bars and warnings are noise. Use with ``pytest.mark.usefixtures``."""
    import torch
    from transformers.utils import logging as hf_logging

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    """The project tokenizer from ``data/tokenizer`` (built with ``data/prepare.py --tokenizer-only`` if missing)."""
    import chinese_tokenizer

    tok_dir = REPO_ROOT / "data" / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        subprocess.run([sys.executable, str(REPO_ROOT / "data" / "prepare.py"), "--tokenizer-only", "--quiet"],
                       cwd=REPO_ROOT, check=True)
    return chinese_tokenizer.load_tokenizer(str(tok_dir))


def load_script(filename: str):
    """Import a numbered stage script (``3-PPO.py`` is not a valid module name) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(filename.replace("-", "_").removesuffix(".py"), REPO_ROOT / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args, timeout=600, env=None):
    """Run ``python <script> args...`` from the repository root; returns the CompletedProcess (never raises).
    ``env`` adds variables to the environment; a value of None removes one."""
    import os

    full_env = {k: v for k, v in {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}.items() if v is not None}
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


TINY_TEXT = ("床前明月光，疑是地上霜。举头望明月，低头思故乡。\n"
             "白日依山尽，黄河入海流。欲穷千里目，更上一层楼。\n"
             "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。\n")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small pretraining corpus (train.txt, val.txt) of classical poems, in a temporary directory."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "train.txt").write_text("\n\n".join([TINY_TEXT] * 12), encoding="utf-8")
    (root / "val.txt").write_text(TINY_TEXT, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_pretrain_checkpoint(tmp_path_factory, tiny_corpus, tokenizer):
    """A ``--preset tiny`` checkpoint written by 0-PRETRAIN.py on the tiny corpus (a parent for later stages)."""
    out = tmp_path_factory.mktemp("ckpt") / "pretrain"
    result = run_script("0-PRETRAIN.py", "--preset", "tiny", "--max_steps", "20", "--eval_every", "20",
                        "--train_files", tiny_corpus / "train.txt", "--val_files", tiny_corpus / "val.txt",
                        "--output_dir", out)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


@pytest.fixture(scope="session")
def tiny_policy_and_rm(tmp_path_factory, tiny_pretrain_checkpoint, tokenizer):
    """The tiny pretrain checkpoint as the policy of the alignment stages (it stands in for SFT), and a reward model
    whose backbone is that checkpoint and whose head is freshly initialised."""
    import torch

    from gpt_model import RewardModel
    from plumbing.checkpoint import load_checkpoint, save_checkpoint

    policy, _, _ = load_checkpoint(str(tiny_pretrain_checkpoint), "gpt")
    torch.manual_seed(0)
    rm = RewardModel(policy.cfg)
    rm.backbone.load_state_dict(policy.state_dict())
    path = tmp_path_factory.mktemp("align_rm") / "rm"
    save_checkpoint(str(path), rm, tokenizer, {"stage": "rm"})
    return tiny_pretrain_checkpoint, path


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    """Four prompts as .jsonl lines: what the online stages practise on, and the held-out prompts of all three."""
    import json

    path = tmp_path_factory.mktemp("align_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n"
                            for p in ("写一条好评：", "写一条差评：", "今天天气", "明月")), encoding="utf-8")
    return path


POEMS = ("床前明月光，疑是地上霜。举头望明月，低头思故乡。"
         "白日依山尽，黄河入海流。欲穷千里目，更上一层楼。"
         "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。")


@pytest.fixture(scope="session")
def fitted_models(tokenizer):
    """Two small models (2 layers x 32, 128 positions, learned and rotary positions) fitted in-process to the
    poems for 150 steps, so that their top tokens are clear, as a trained model's are: for comparisons with other
    engines (llama.cpp, lm-eval), where a near-tie of a barely trained model would flip on float32 rounding."""
    import torch

    from chinese_tokenizer import encode
    from gpt_model import GPTConfig, GPTModel

    models = {}
    for position in ("learned", "rope"):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(context_length=128, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                                   position_embedding=position))
        ids = torch.tensor([encode(POEMS, tokenizer)])  # (1, T)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(150):
            loss = model.loss(model(ids[:, :-1])["last_hidden_state"], ids[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        models[position] = model.eval()
    return models
