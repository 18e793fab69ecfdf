"""The GPU path: what every other test checks on the CPU, checked on CUDA (marker ``cuda``).

Every test here is skipped, with the reason printed, on a machine without a CUDA device, which is every machine the
suite usually runs on; ``bench/gpu_check.py`` runs them on a GPU (``pytest -m cuda tests/test_cuda.py``). The
expected values come from the CPU (fp32 forward and backward), from a written-out cache-less greedy loop, from the
fp32 rotation, from an uninterrupted run, and from ``transformers`` on the same weights.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO_ROOT, TINY_TEXT, run_script
from gpt_model import GPTConfig, GPTModel, apply_rope, generate, rope_angles
from plumbing.optimizers import make_optimizer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device on this machine; bench/gpu_check.py runs these on a GPU")]

CONFIGS = {  # GPT-2's layout, and the demo's rotary positions with RMSNorm and q/k/v biases
    "layernorm-learned": dict(norm="layernorm", position_embedding="learned"),
    "rmsnorm-rope": dict(norm="rmsnorm", position_embedding="rope", qkv_bias=True, tie_embeddings=False),
}


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """fp32 products in full fp32 (no TF32), so CUDA and the CPU compute the same function to ~1e-6."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def small(name, **changes):
    return GPTConfig(vocab_size=500, context_length=48, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0,
                     **{**CONFIGS[name], **changes})


def randomised(model, seed=0):
    """Every weight random and large, so logits are spread (the default init gives nearly flat logits)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("scale") else p.normal_(0.0, 0.3)
    return model


def left_padded(vocab_size, seed=1):
    """(ids, attention_mask): three rows of 24 tokens, the first two left-padded by 5 and 11."""
    ids = torch.randint(1, vocab_size, (3, 24), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :11] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_and_backward_on_cuda_match_the_cpu_in_fp32(name):
    cpu = randomised(GPTModel(small(name)))
    gpu = randomised(GPTModel(small(name))).cuda()
    ids, mask = left_padded(500)
    labels = ids.roll(-1, dims=1).masked_fill(mask == 0, -100)
    results = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        out = model(ids.to(device), attention_mask=mask.to(device))
        loss = model(ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))["loss"]
        loss.backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
        results.append((out["logits"].detach().cpu(), loss.item(), grads))
    (logits_cpu, loss_cpu, grads_cpu), (logits_gpu, loss_gpu, grads_gpu) = results
    real = mask.bool()
    assert (logits_cpu - logits_gpu)[real].abs().max() <= 1e-4
    assert abs(loss_cpu - loss_gpu) <= 1e-4
    for n, g in grads_cpu.items():
        assert (g - grads_gpu[n]).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), n


@pytest.mark.parametrize("name", CONFIGS)
def test_a_bf16_autocast_training_step_is_finite_and_moves_the_weights(name):
    model = GPTModel(small(name)).cuda()
    optimizer = make_optimizer(model, 1e-3, 0.1, "adamw")  # the fused AdamW every stage uses
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, 500, (4, 32), device="cuda")
    labels = ids.roll(-1, dims=1)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels)["loss"]
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n.endswith("weight"))


def greedy_without_cache(model, ids, mask, steps):
    """The walkthrough's loop: the whole sequence through the model at every step, argmax of the last position."""
    for _ in range(steps):
        logits = model(ids, attention_mask=mask)["logits"][:, -1]  # (B, V)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


@pytest.mark.parametrize("name", CONFIGS)
def test_generate_with_the_kv_cache_equals_the_loop_without_it_on_cuda(name):
    model = randomised(GPTModel(small(name))).cuda().eval()
    ids, mask = left_padded(500)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        expected = greedy_without_cache(model, ids, mask, 16)
    assert torch.equal(generate(model, ids, 16, 48, attention_mask=mask), expected)
    # sampling draws from the GPU's generator: the same seed gives the same tokens
    torch.manual_seed(5)
    a = generate(model, ids, 16, 48, temperature=1.0, top_k=50, attention_mask=mask)
    torch.manual_seed(5)
    assert torch.equal(generate(model, ids, 16, 48, temperature=1.0, top_k=50, attention_mask=mask), a)


def test_rope_in_bf16_on_cuda_rotates_as_in_fp32():
    x = torch.randn(2, 4, 40, 16, generator=torch.Generator().manual_seed(0))  # (B, H, T, d_h)
    rotation = rope_angles(16, torch.arange(40).expand(2, -1))
    expected = apply_rope(x, rotation)  # fp32 on the CPU
    got = apply_rope(x.cuda().bfloat16(), rotation.cuda())
    assert got.dtype == torch.bfloat16  # the rotation is done in fp32 and cast back, never in complex bf16
    # each element carries bf16's rounding of x (relative 2^-8) and of the result
    assert (got.float().cpu() - expected).abs().max() <= 2 * 2 ** -8 * x.abs().max()
    model = randomised(GPTModel(small("rmsnorm-rope")), seed=3).cuda().eval()
    ids, mask = left_padded(500)
    with torch.no_grad():
        full = model(ids.cuda(), attention_mask=mask.cuda())["logits"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            half = model(ids.cuda(), attention_mask=mask.cuda())["logits"]
    assert torch.isfinite(half).all()
    real = mask.bool().cuda()
    agree = (half.float().argmax(-1) == full.argmax(-1))[real].float().mean()
    assert agree >= 0.9  # bf16 moves a few near-ties, not the model's answer


def has_data() -> bool:
    return (REPO_ROOT / "data" / "MANIFEST.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not has_data(), reason="the pipeline needs data/ (python data/prepare.py)")
def test_tiny_pipeline_under_accelerate_launch_bf16(tmp_path):
    """The whole pipeline at the tiny preset, each stage started by `accelerate launch --mixed_precision bf16`, in a
    copy of the code (the pipeline writes its checkpoints beside itself)."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from gpu_check import isolated_checkout

    repo = Path(isolated_checkout(str(tmp_path / "repo")))
    launch = f"{sys.executable} -m accelerate.commands.launch --num_processes 1 --mixed_precision bf16"
    result = subprocess.run([sys.executable, "pipeline.py", "--preset", "tiny", "--launch", launch], cwd=repo,
                            capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (repo / "reports" / "report.md").is_file()
    for stage in ("pretrain", "sft", "rm", "ppo", "dpo", "grpo"):
        config = json.loads((repo / "checkpoints" / stage / "config.json").read_text(encoding="utf-8"))
        assert config["mixed_precision"] == "bf16", stage
        assert config["device"] == torch.cuda.get_device_name(), stage


@pytest.fixture
def dropout_checkpoint(tmp_path, tokenizer):
    """A tiny model with dropout 0.1, so that training draws from the GPU's generator."""
    from plumbing.checkpoint import save_checkpoint

    torch.manual_seed(0)
    path = tmp_path / "init"
    save_checkpoint(str(path), GPTModel(GPTConfig(context_length=64, emb_dim=32, n_heads=2, n_layers=2,
                                                  drop_rate=0.1)), tokenizer, {"stage": "pretrain"})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join([TINY_TEXT] * 12), encoding="utf-8")
    return path, corpus


@pytest.mark.slow
def test_resume_on_cuda_is_bit_identical_with_deterministic_kernels(tmp_path, dropout_checkpoint):
    """3 steps, stop, --resume to 6 gives the weights of 6 steps straight, on the GPU, with dropout and bf16: the
    GPU generator is saved and restored, and --deterministic makes the kernels repeat themselves."""
    init, corpus = dropout_checkpoint
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}

    def pretrain(out, *extra):
        result = run_script("0-PRETRAIN.py", "--preset", "tiny", "--init", init, "--train_files", corpus,
                            "--val_files", corpus, "--max_steps", "6", "--eval_every", "2", "--deterministic",
                            "--output_dir", out, *extra, env=env)
        assert result.returncode == 0, result.stderr[-2000:]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pretrain(straight)
    pretrain(resumed, "--stop_after", "3")
    pretrain(resumed, "--resume")
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", CONFIGS)
def test_export_to_transformers_gives_our_logits_on_cuda(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from plumbing import hf_weights

    ours = randomised(GPTModel(small(name))).eval()
    hf_weights.save_hf_model(ours, str(tmp_path / "hf"))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).cuda().eval()
    ours = ours.cuda()
    ids, mask = left_padded(500)
    ids, mask = ids.cuda(), mask.cuda()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask)["logits"]
    assert (expected - got)[mask.bool()].abs().max() <= 1e-4
    prompt = ids[2:3, :8]
    greedy = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt, 16, 48).tolist() == greedy.tolist()
    shutil.rmtree(tmp_path / "hf")

