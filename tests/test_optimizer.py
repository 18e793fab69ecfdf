"""Muon + AdamW behind one optimizer (training.MuonAdamW): which parameters go where, and exact resume."""

import types

import pytest
import torch

from gpt_model import GPTModel, get_preset
from plumbing.optimizers import MuonAdamW, make_optimizer, make_optimizer_groups, set_lr
from plumbing.training import load_training_state, save_training_state


def tiny_model(seed=0, **changes):
    torch.manual_seed(seed)
    return GPTModel(get_preset("tiny").replace(vocab_size=50, **changes))


def test_groups_put_block_matrices_in_muon_and_embeddings_in_adamw():
    """Every parameter once; Muon gets exactly the 2-D weights inside the blocks; the tied embedding has its own
    AdamW group with its lr_scale; norms, biases and positions are not decayed."""
    model = tiny_model()
    groups = make_optimizer_groups(model, 0.1, muon=True, embedding_lr_scale=30.0, muon_lr_scale=10.0)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [{names[id(p)] for p in g["params"]} for g in groups]
    muon, embedding, rest = by_group
    assert all(n.startswith("trf_blocks.") and n.endswith(".weight") and "norm" not in n for n in muon)
    assert "trf_blocks.1.ff.layers.2.weight" in muon and "trf_blocks.0.att.W_key.weight" in muon
    assert embedding == {"tok_emb.weight"}  # the tied head is the same tensor
    assert {"pos_emb.weight", "final_norm.scale", "trf_blocks.0.ff.layers.0.bias"} <= rest
    assert sum(len(s) for s in by_group) == len(list(model.parameters()))
    assert [g.get("muon", False) for g in groups] == [True, False, False]
    assert [g["lr_scale"] for g in groups[:2]] == [10.0, 30.0] and groups[2]["weight_decay"] == 0.0

    untied = make_optimizer_groups(tiny_model(tie_embeddings=False), 0.1, muon=True)
    assert [len(g["params"]) for g in untied][1:3] == [1, 1]  # embedding alone, then the decayed head


def test_adamw_gives_the_embedding_tables_their_own_rate_only_when_asked():
    """make_optimizer's AdamW (the fine-tuning stages'): with embedding_lr_scale the token and position tables form a
    third, undecayed group whose rate set_lr multiplies; without it the two groups are as before, and every
    parameter is in exactly one group either way."""
    model = tiny_model()
    names = {id(p): n for n, p in model.named_parameters()}
    plain = make_optimizer(model, 1e-3, 0.1).param_groups
    assert len(plain) == 2 and "tok_emb.weight" in {names[id(p)] for p in plain[1]["params"]}
    scaled = make_optimizer(model, 1e-3, 0.1, embedding_lr_scale=30.0)
    decay, no_decay, tables = ({names[id(p)] for p in g["params"]} for g in scaled.param_groups)
    assert tables == {"tok_emb.weight", "pos_emb.weight"} and not tables & (decay | no_decay)
    assert "trf_blocks.0.att.W_key.weight" in decay and "final_norm.scale" in no_decay
    assert sum(len(g["params"]) for g in scaled.param_groups) == len(list(model.parameters()))
    set_lr(scaled, 1e-3)
    assert [g["lr"] for g in scaled.param_groups] == pytest.approx([1e-3, 1e-3, 3e-2])
    assert scaled.param_groups[2]["weight_decay"] == 0.0


def step(model, optimizer, seed, lr=1e-2):
    set_lr(optimizer, lr)
    torch.manual_seed(seed)
    ids = torch.randint(0, 50, (2, 9))
    model(ids[:, :-1], labels=ids[:, 1:])["loss"].backward()
    optimizer.step()
    optimizer.zero_grad()


def test_set_lr_reaches_both_inner_optimizers():
    model = tiny_model()
    optimizer = MuonAdamW(make_optimizer_groups(model, 0.1, muon=True, muon_lr_scale=10.0), lr=1e-3)
    set_lr(optimizer, 2e-3)
    assert optimizer._muon.param_groups[0]["lr"] == pytest.approx(2e-2)
    assert optimizer._adamw.param_groups[0]["lr"] == pytest.approx(2e-3)
    before = [p.detach().clone() for p in model.parameters()]
    step(model, optimizer, 0)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # every parameter moved


def test_resume_through_saved_state_is_bit_identical(tmp_path):
    """2 steps, save (safetensors + JSON), load into a new model and optimizer, 2 more = 4 steps straight."""
    def new():
        model = tiny_model()
        return model, MuonAdamW(make_optimizer_groups(model, 0.1, muon=True), lr=1e-3, betas=(0.8, 0.95))

    straight, opt = new()
    for s in range(4):
        step(straight, opt, s)
    first, opt = new()
    for s in range(2):
        step(first, opt, s)
    save_training_state(str(tmp_path), opt, {"step": 2}, torch.get_rng_state()[None])
    resumed, opt = new()
    resumed.load_state_dict(first.state_dict())
    single = types.SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    assert load_training_state(str(tmp_path), opt, single) == {"step": 2}
    assert opt._muon.state is opt.state and opt._adamw.param_groups[0] is opt.param_groups[0]
    for s in range(2, 4):
        step(resumed, opt, s)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_pretrain_stage_with_muon_resumes_bit_identically(tmp_path, tiny_corpus):
    """0-PRETRAIN --optimizer muon: 3 steps, stop, --resume to 6 gives the weights of 6 steps straight."""
    from safetensors.torch import load_file

    from conftest import run_script

    def pretrain(out, *extra):
        return run_script("0-PRETRAIN.py", "--preset", "tiny", "--optimizer", "muon", "--max_steps", "6",
                          "--eval_every", "3", "--train_files", tiny_corpus / "train.txt",
                          "--val_files", tiny_corpus / "val.txt", "--output_dir", out, *extra)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert pretrain(straight).returncode == 0
    assert pretrain(resumed, "--stop_after", "3").returncode == 0
    result = pretrain(resumed, "--resume")
    assert result.returncode == 0, result.stderr[-1500:]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_newton_schulz_in_bf16_is_torchs_iteration_bitwise():
    """Our iteration in bf16 is torch.optim.Muon's, operation for operation, on wide and tall matrices; in float32
    it is close to it and its singular values are near 1 (the point of the iteration)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from plumbing.optimizers import NEWTON_SCHULZ_COEFFICIENTS, newton_schulz

    torch.manual_seed(0)
    for shape in ((8, 24), (24, 8), (16, 16)):
        g = torch.randn(shape)
        ours = newton_schulz(g, 5, torch.bfloat16)
        assert torch.equal(ours, _zeropower_via_newtonschulz(g, NEWTON_SCHULZ_COEFFICIENTS, 5, 1e-7))
        fp32 = newton_schulz(g, 5, torch.float32)
        assert fp32.dtype == torch.float32 and (fp32 - ours.float()).abs().max() < 0.05
        singular = torch.linalg.svdvals(fp32)
        assert singular.min() > 0.4 and singular.max() < 1.5  # roughly 0.5-1.5 (Jordan)


def test_muon_step_matches_torch_muon_in_bf16_and_picks_fp32_without_native_bf16(monkeypatch):
    """Three steps of our Muon with a bf16 iteration leave the weights and momentum of torch.optim.Muon
    (adjust_lr_fn="original") bit for bit; the default precision follows native_bf16()."""
    from plumbing import optimizers as training

    def run(make):
        torch.manual_seed(1)
        w = torch.nn.Parameter(torch.randn(12, 20))
        opt = make([w])
        for s in range(3):
            torch.manual_seed(10 + s)
            w.grad = torch.randn(12, 20)
            opt.step()
        return w.detach(), opt.state[w]["momentum_buffer"]

    ours = run(lambda p: training.Muon(p, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16))
    theirs = run(lambda p: torch.optim.Muon(p, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="original"))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    monkeypatch.setattr(training, "native_bf16", lambda: False)
    assert training.Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1).ns_dtype == torch.float32
    monkeypatch.setattr(training, "native_bf16", lambda: True)
    assert training.Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1).ns_dtype == torch.bfloat16
