"""LoRA in the stages (--lora_rank in 1-SFT.py, 3-DPO.py, 3-GRPO.py, 3-PPO.py) and out of them (load_weight.py):
only the adapters train, the frozen reference is the same network with its adapters off, a resumed run equals a
straight one, and peft reads the exported adapter back to our logits."""

import copy
import json
import math
import types

import pytest
import torch

from conftest import load_script, run_script
from gpt_model import GPTConfig, GPTModel
from lora import AdaptersOff, add_lora, lora_state_dict
from plumbing.checkpoint import file_sha256, load_checkpoint

PAIRS = [("写一条好评：", "房间干净，服务很好。"), ("写一条差评：", "房间很脏，服务太差。"),
         ("你好", "你好，有什么可以帮你？"), ("明月", "床前明月光。")] * 4


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def plain_weights(model) -> dict:
    """The state dict without the adapters: what the base holds."""
    return {k: v for k, v in model.state_dict().items() if ".lora_" not in k}


def test_the_adapters_off_reference_is_a_frozen_copy_in_eval_mode():
    """AdaptersOff(policy) gives exactly the logits of a separate frozen copy of the base in eval mode, even while
    the policy trains (train mode, dropout on) with adapters far from zero; it owns no parameters and leaves the
    policy's mode as it found it."""
    cfg = GPTConfig(vocab_size=61, context_length=16, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.3)
    torch.manual_seed(0)
    policy = GPTModel(cfg)
    frozen = copy.deepcopy(policy).eval()
    add_lora(policy, rank=4, alpha=8.0, targets="all", dropout=0.3)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith(".lora_B"):
                p.normal_(0, 0.5)
    policy.train()
    ref = AdaptersOff(policy)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    out = ref(ids)["logits"]
    assert torch.equal(out, frozen(ids)["logits"]) and not out.requires_grad
    assert policy.training and list(ref.parameters()) == [] and ref.cfg is cfg
    with torch.no_grad():
        assert not torch.allclose(policy.eval()(ids)["logits"], out, atol=1e-3)  # the adapters do change the policy


def test_ppo_critic_from_a_lora_policy_is_its_base_saying_zero():
    """With a verifier PPO's critic starts from the policy; a LoRA policy's adapters are left out of it (they are
    zero at step 0) and the critic is a plain network of its own."""
    PPO = load_script("3-PPO.py")
    cfg = GPTConfig(vocab_size=61, context_length=16, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
    torch.manual_seed(0)
    policy = add_lora(GPTModel(cfg), rank=2, alpha=4.0)
    critic = PPO.make_critic(types.SimpleNamespace(policy=policy, reward_model=None))
    assert critic.backbone.state_dict().keys() == plain_weights(policy).keys()
    assert all(torch.equal(critic.backbone.state_dict()[k], v) for k, v in plain_weights(policy).items())
    assert all(p.requires_grad for p in critic.parameters())


@pytest.mark.parametrize("flags, named", [(["--lora_targets", "all"], "--lora_targets"),
                                           (["--lora_alpha", "16"], "--lora_alpha"),
                                           (["--lora_rank", "8", "--optimizer", "muon"], "--optimizer muon")])
def test_lora_flags_that_would_be_ignored_or_crash_are_refused(flags, named):
    """A LoRA flag without --lora_rank would be silently ignored, and Muon would take the adapters' matrices and
    leave AdamW nothing: each is refused with one line naming the flag, before anything loads."""
    from plumbing.cli import UserError

    SFT = load_script("1-SFT.py")
    with pytest.raises(UserError, match=named):
        SFT.parse_args(["--preset", "tiny", *flags])
    args = SFT.parse_args(["--preset", "tiny", "--lora_rank", "8"])  # the defaults: the paper's q and v, alpha 2r
    assert args.lora_targets == ("att.W_query", "att.W_value") and args.lora_alpha == 16.0


def test_a_rank_above_the_layers_width_is_warned_about():
    cfg = GPTConfig(vocab_size=61, context_length=16, emb_dim=32, n_heads=4, n_layers=1, drop_rate=0.0)
    with pytest.warns(UserWarning, match="exceeds the smallest adapted layer's 32 features"):
        add_lora(GPTModel(cfg), rank=48, alpha=96.0)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("lora_pairs") / "pairs.jsonl",
                       [{"prompt": p, "response": r} for p, r in PAIRS])


def sft_args(init, pairs, out, *extra):
    return ["--preset", "tiny", "--init", str(init), "--train_files", str(pairs), "--val_files", str(pairs),
            "--output_dir", str(out), "--max_steps", "6", "--eval_every", "6", "--learning_rate", "1e-2",
            "--lora_rank", "4", *map(str, extra)]


@pytest.fixture(scope="module")
def lora_sft(tmp_path_factory, tiny_pretrain_checkpoint, pairs_file):
    """A LoRA SFT run of 6 steps on the tiny pretrain checkpoint, and the same run stopped after 3 and resumed."""
    SFT = load_script("1-SFT.py")
    root = tmp_path_factory.mktemp("lora_sft")
    assert SFT.main(sft_args(tiny_pretrain_checkpoint, pairs_file, root / "straight", "--lora_targets", "all")) == 0
    assert SFT.main(sft_args(tiny_pretrain_checkpoint, pairs_file, root / "halves", "--lora_targets", "all",
                             "--stop_after", "3")) == 0
    assert SFT.main(sft_args(tiny_pretrain_checkpoint, pairs_file, root / "halves", "--lora_targets", "all",
                             "--resume")) == 0
    return root / "straight", root / "halves"


@pytest.mark.slow
def test_lora_sft_trains_the_adapters_alone_and_resumes_exactly(lora_sft, tiny_pretrain_checkpoint):
    straight, halves = lora_sft
    assert not (straight / "model.safetensors").exists() and (straight / "adapter.safetensors").is_file()
    config = json.loads((straight / "config.json").read_text(encoding="utf-8"))
    assert config["lora"] == {"rank": 4, "alpha": 8.0, "dropout": config["model"]["drop_rate"],
                              "targets": ["att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0",
                                          "ff.layers.2"]}
    assert config["base_sha256"] == file_sha256(str(tiny_pretrain_checkpoint / "model.safetensors"))
    model, _, _ = load_checkpoint(str(straight), "gpt")
    base, _, _ = load_checkpoint(str(tiny_pretrain_checkpoint), "gpt")
    assert all(torch.equal(plain_weights(model)[k], v) for k, v in base.state_dict().items())  # the base never moved
    assert all(v.abs().sum() > 0 for k, v in lora_state_dict(model).items() if k.endswith("lora_B"))  # B trained
    # N + N == 2N: the adapters, the optimizer and the RNG come back from state/
    assert (straight / "adapter.safetensors").read_bytes() == (halves / "adapter.safetensors").read_bytes()


@pytest.mark.slow
def test_lora_sft_refuses_a_resume_with_other_lora_flags(lora_sft, tiny_pretrain_checkpoint, pairs_file, tmp_path):
    result = run_script("1-SFT.py", *sft_args(tiny_pretrain_checkpoint, pairs_file, tmp_path / "run",
                                              "--stop_after", "2"))
    assert result.returncode == 0, result.stderr[-2000:]
    result = run_script("1-SFT.py", *sft_args(tiny_pretrain_checkpoint, pairs_file, tmp_path / "run", "--resume",
                                              "--lora_targets", "all"))
    assert result.returncode != 0 and "--lora_rank" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_lora_dpo_grpo_and_ppo_start_as_their_reference_and_grpo_resumes_exactly(tmp_path, tiny_policy_and_rm, prompts,
                                                                              pairs_file):
    """Step 0: the adapters-off reference equals the policy, so DPO's loss is exactly log 2 and the held-out KL 0;
    GRPO with adapters resumes bit for bit and writes an adapter over its policy; PPO runs with them too."""
    DPO, GRPO = load_script("3-DPO.py"), load_script("3-GRPO.py")
    policy, rm = tiny_policy_and_rm
    pref = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": p, "chosen": r, "rejected": "差"} for p, r in PAIRS])
    out = tmp_path / "dpo"
    assert DPO.main(["--preset", "tiny", "--policy", str(policy), "--reward", str(rm), "--val_prompts_file",
                     str(prompts), "--train_files", str(pref), "--val_files", str(pref), "--output_dir", str(out),
                     "--max_steps", "4", "--eval_every", "4", "--max_new_tokens", "8", "--lora_rank", "2",
                     "--learning_rate", "1e-2"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6) and rows[0]["val_kl"] == 0.0
    assert rows[-1]["val_loss"] < math.log(2)  # the adapters learnt the preference
    assert (out / "adapter.safetensors").is_file() and not (out / "model.safetensors").exists()

    def grpo(out, *extra):
        return GRPO.main(["--preset", "tiny", "--policy", str(policy), "--reward", str(rm), "--prompts_file",
                          str(prompts), "--val_prompts_file", str(prompts), "--output_dir", str(out),
                          "--max_new_tokens", "8", "--eval_examples", "4", "--max_steps", "4", "--lora_rank", "2",
                          *extra])

    assert grpo(tmp_path / "straight") == 0
    assert grpo(tmp_path / "halves", "--stop_after", "2") == 0 and grpo(tmp_path / "halves", "--resume") == 0
    assert ((tmp_path / "straight" / "adapter.safetensors").read_bytes()
            == (tmp_path / "halves" / "adapter.safetensors").read_bytes())
    held = json.loads((tmp_path / "straight" / "config.json").read_text(encoding="utf-8"))["metrics"]["held_out"]
    assert held["sft"]["kl"] == 0.0

    PPO = load_script("3-PPO.py")  # its critic, started from the RM, trains whole beside the policy's adapters
    assert PPO.main(["--preset", "tiny", "--policy", str(policy), "--reward", str(rm), "--prompts_file", str(prompts),
                     "--val_prompts_file", str(prompts), "--output_dir", str(tmp_path / "ppo"), "--max_steps", "2",
                     "--max_new_tokens", "8", "--eval_examples", "4", "--lora_rank", "2"]) == 0
    assert (tmp_path / "ppo" / "adapter.safetensors").is_file()


@pytest.mark.slow
def test_a_lora_checkpoint_leaves_as_a_peft_adapter_and_as_a_merged_checkpoint(lora_sft, tmp_path):
    """load_weight.py --to_hf --peft: transformers' base plus peft's adapter give our logits (left and right
    padding); --merge: a full checkpoint with the same logits and no base needed; generate.py reads the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    straight, _ = lora_sft
    ours, tokenizer, _ = load_checkpoint(str(straight), "gpt")
    result = run_script("load_weight.py", "--checkpoint", straight, "--to_hf", tmp_path / "hf", "--peft")
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "base"),
                                       tmp_path / "hf" / "adapter").eval()
    # the adapter names its base by absolute path, so peft's one-call loader finds it from any working directory
    assert theirs.peft_config["default"].base_model_name_or_path == str(tmp_path / "hf" / "base")
    ids = torch.tensor([[0, 0, 101, 2769, 4263, 102], [101, 2769, 4263, 3300, 1962, 102]])
    for mask in (torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]), torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])):
        with torch.no_grad():
            want = ours(ids, attention_mask=mask)["logits"]
            # positions counted from each row's first real token, as ours count them
            got = theirs(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        real = mask.bool()
        assert torch.allclose(got[real], want[real], atol=1e-4)

    result = run_script("load_weight.py", "--checkpoint", straight, "--merge", tmp_path / "merged")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    merged, _, config = load_checkpoint(str(tmp_path / "merged"), "gpt")
    assert "lora" not in config and config["merged_from"]["adapter_sha256"] == file_sha256(
        str(straight / "adapter.safetensors"))
    with torch.no_grad():
        assert torch.allclose(merged(ids)["logits"], ours(ids)["logits"], atol=1e-5)
    result = run_script("generate.py", "--checkpoint", straight, "--prompt", "你好", "--max_new_tokens", "4")
    assert result.returncode == 0, result.stderr[-2000:]
