"""Export the pipeline's models to transformers and check that transformers reproduces them, text and all.

For the policy (default ``checkpoints/ppo``): ``load_weight.save_hf_model`` writes it (GPT-NeoX for the demo's
rotary positions), ``AutoModelForCausalLM`` loads it, and on the report card's prompts, built by the exported
tokenizer's chat template, ``transformers``' ``generate`` must give our greedy answers token for token (plain
greedy, and greedy with the report's repetition penalty), one prompt at a time and all prompts in one left-padded
batch; the largest logit difference on a padded batch is printed. For the pretrained model (default
``checkpoints/pretrain``): ``pipeline("text-generation", model=export)`` must return, greedily, each prompt
followed by the text ``generate.py --temperature 0`` writes for the checkpoint. For the reward model (default
``checkpoints/rm``): ``AutoModelForSequenceClassification`` on the exported chat template over (user, assistant)
turns must score texts of different lengths in one padded batch, left and right, as ``score_texts`` (what
``2-RM.py --score`` prints) does. Prompts and texts include special tokens' names typed as text ("[SEP]"), which
must stay text. Prints Markdown tables; exits 1 on a mismatch.

    python bench/export_parity.py [--policy checkpoints/ppo] [--pretrain checkpoints/pretrain]
                                  [--reward checkpoints/rm] [--max_new_tokens 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chinese_tokenizer import SEP_ID, chat_prompt_ids, decode, until_eos  # noqa: E402
from gpt_fast import generate, speed_up  # noqa: E402
from plumbing.checkpoint import load_checkpoint  # noqa: E402
from plumbing.hf_weights import save_hf_model  # noqa: E402
from plumbing.inference import prompt_to_ids  # noqa: E402
from plumbing.markdown import markdown_table  # noqa: E402
from plumbing.report import REPORT_PROMPTS  # noqa: E402
from plumbing.reward import score_texts  # noqa: E402

RM_TEXTS = [("", "房间很干净，服务也好。"), ("这家酒店怎么样？", "太吵了"),
            ("写一条好评：", "位置不错，早餐种类很多，下次还来。"), ("", "差"),
            ("评价一下这家店", "菜量很足，价格实惠，服务员态度热情，停车也方便。"),
            ("写一条好评：[SEP]", "房间[SEP]很干净[ANS]服务也好。")]
CONTINUE_PROMPTS = ["中国人民", "今天天气", "刘备说：", "经济[SEP]发展"]


def cut_at_eos(ids):
    return ids[:ids.index(SEP_ID) + 1] if SEP_ID in ids else ids


def policy_parity(path, out, max_new_tokens):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer, config = load_checkpoint(path, "gpt")
    speed_up(model)
    written = save_hf_model(model, out, tokenizer, chat=True)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    rows, ok = [], True
    prompts = [hf_tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True, return_dict=False)
               for p in REPORT_PROMPTS + ["你好[SEP]"]]
    assert prompts == [chat_prompt_ids(p, tokenizer) for p in REPORT_PROMPTS + ["你好[SEP]"]], "chat template differs"
    prompts = prompts[:-1]
    for penalty in (1.0, 1.1):
        hf_tokenizer.padding_side = "left"
        batch = hf_tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        with torch.no_grad():
            batched = hf.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=SEP_ID,
                                  pad_token_id=0, repetition_penalty=penalty)
        for i, (prompt, ids) in enumerate(zip(REPORT_PROMPTS, prompts)):
            x = torch.tensor([ids])
            ours = cut_at_eos(generate(model, x, max_new_tokens, model.cfg.context_length, eos_id=SEP_ID,
                                       repetition_penalty=penalty)[0, len(ids):].tolist())
            with torch.no_grad():
                alone = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=SEP_ID, pad_token_id=0,
                                    repetition_penalty=penalty)[0, len(ids):].tolist()
            in_batch = cut_at_eos(batched[i, batch["input_ids"].shape[1]:].tolist())
            same, same_batched = ours == cut_at_eos(alone), ours == in_batch
            ok &= same and same_batched
            rows.append((prompt, penalty, len(ours), "yes" if same else "NO", "yes" if same_batched else "NO",
                         decode(ours, tokenizer)[:40]))
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in prompts], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], batch_first=True)
    with torch.no_grad():
        diff = (hf(ids, attention_mask=mask).logits - model(ids, attention_mask=mask)["logits"])[mask.bool()]
    print(f"policy {path} (stage {config.get('stage')}) -> {written}; largest |logit difference| on the right-padded "
          f"prompts: {diff.abs().max():.2e}\n")
    print(markdown_table(("prompt", "repetition penalty", "answer tokens", "greedy same, alone",
                          "same, in a left-padded batch", "answer"), rows))
    return ok


def pretrain_parity(path, out, max_new_tokens):
    from transformers import pipeline

    model, tokenizer, config = load_checkpoint(path, "gpt")
    speed_up(model)
    written = save_hf_model(model, out, tokenizer)
    generator = pipeline("text-generation", model=out, device="cpu")
    rows, ok = [], True
    for prompt in CONTINUE_PROMPTS:
        ids = prompt_to_ids(prompt, tokenizer, False, model.cfg.context_length, model.cfg.bos_id)  # generate.py's
        x = torch.tensor([ids])
        ours = prompt + decode(until_eos(generate(model, x, max_new_tokens, model.cfg.context_length,
                                                  eos_id=SEP_ID)[0, len(ids):].tolist()), tokenizer)
        theirs = generator(prompt, max_new_tokens=max_new_tokens, do_sample=False)[0]["generated_text"]
        ok &= theirs == ours
        rows.append((prompt, "yes" if theirs == ours else "NO", theirs[:40]))
    print(f"pretrained model {path} (stage {config.get('stage')}) -> {written}; pipeline(\"text-generation\") "
          f"against generate.py --temperature 0\n")
    print(markdown_table(("prompt", "same text", "pipeline's text"), rows))
    return ok


def reward_parity(path, out):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer, _ = load_checkpoint(path, "reward")
    written = save_hf_model(model, out, tokenizer)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    expected = score_texts(model, tokenizer, [p for p, _ in RM_TEXTS], [r for _, r in RM_TEXTS])
    worst = {}
    for side in ("left", "right"):
        hf_tokenizer.padding_side = side
        conversations = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in RM_TEXTS]
        batch = hf_tokenizer.apply_chat_template(conversations, padding=True, return_tensors="pt")
        with torch.no_grad():
            scores = hf(**batch).logits[:, 0].tolist()
        worst[side] = max(abs(a - b) for a, b in zip(scores, expected))
    print(f"reward model {path} -> {written}; {len(RM_TEXTS)} texts of {int(batch['attention_mask'].sum(1).min())}"
          f"..{batch['input_ids'].shape[1]} positions, scores {', '.join(f'{s:.3f}' for s in expected)}; largest "
          f"|difference| from score_texts: left padding {worst['left']:.1e}, right padding {worst['right']:.1e}\n")
    return max(worst.values()) <= 1e-4


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default="checkpoints/ppo")
    p.add_argument("--pretrain", default="checkpoints/pretrain")
    p.add_argument("--reward", default="checkpoints/rm")
    p.add_argument("--max_new_tokens", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(0)
    started = time.time()
    print(f"{cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, fp32\n")
    with tempfile.TemporaryDirectory() as tmp:
        ok = policy_parity(args.policy, os.path.join(tmp, "policy"), args.max_new_tokens)
        ok &= pretrain_parity(args.pretrain, os.path.join(tmp, "pretrain"), args.max_new_tokens)
        ok &= reward_parity(args.reward, os.path.join(tmp, "rm"))
    print(f"{'all match' if ok else 'MISMATCH'} ({time.time() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
