"""Loading a model to answer with: what generate.py and serve.py share.

* ``add_model_arguments`` / ``load_policy``: ``--checkpoint`` (any language-model stage; the default is the
  furthest stage found, ``find_latest_checkpoint``) or ``--from_hf`` (a Hugging Face directory, ``hf_weights.py``),
  and whether the model answers through the chat template.
* ``check_reward_dir`` / ``load_reward``: the ``--reward`` model of best-of-n and of the server's scores.
* ``prompt_to_ids``: a prompt (or a conversation) as model input, cut from the left to fit the context.
* ``DTYPES`` / ``add_dtype_argument`` / ``weight_dtype``: the precision of the weights while generating.
"""

from __future__ import annotations

import os
import sys

import torch

from chinese_tokenizer import CHAT_TEMPLATE, chat_messages_ids, encode
from lora import merge_lora
from plumbing.checkpoint import CHAT_STAGES, check_vocab, load_checkpoint, read_config
from plumbing.cli import UserError, default_path

# Where the stages write their checkpoints, furthest stage first: the default --checkpoint is the first that exists.
STAGE_DIRS = [default_path("checkpoints", stage) for stage in ("ppo", "sft", "pretrain")]


def add_model_arguments(p) -> None:
    """Where the model comes from (``--checkpoint`` or ``--from_hf``, and ``--tokenizer``): generate.py's and
    serve.py's, read by ``load_policy``."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="stage checkpoint directory (default: the first that exists of "
                                             "checkpoints/ppo, checkpoints/sft, checkpoints/pretrain)")
    source.add_argument("--from_hf", help="a local Hugging Face directory (GPT-2, or an export of load_weight.py: "
                                          "GPT-2, GPT-NeoX, Arcee); chat template if its tokenizer has ours, "
                                          "else plain continuation")
    p.add_argument("--tokenizer", help="tokenizer directory for --from_hf (default: the directory's own vocab.txt "
                                       "if it is the BERT-Chinese one, else data/tokenizer); checkpoints carry theirs")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def find_latest_checkpoint() -> str:
    """The first of checkpoints/ppo, sft, pretrain that holds a checkpoint. Raises ``UserError`` if none does."""
    for path in STAGE_DIRS:
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    raise UserError(f"no checkpoint in {', '.join(STAGE_DIRS)}; run 0-PRETRAIN.py first or pass --checkpoint DIR")


def load_policy(args):
    """The model to generate with: ``(model, tokenizer, chat)``, where ``chat`` says whether to use the template."""
    if args.from_hf:
        from plumbing.hf_weights import import_tokenizer, load_hf_model

        if not os.path.isdir(args.from_hf):
            raise UserError(f"--from_hf {args.from_hf} is not a directory; give a local Hugging Face folder (GPT-2, "
                            f"or an export of load_weight.py)")
        model = load_hf_model(args.from_hf, want="gpt")
        tokenizer = import_tokenizer(args.from_hf, args.tokenizer)
        check_vocab(tokenizer, model.cfg.vocab_size, f"--from_hf {args.from_hf}", "use Chinese GPT-2 weights with "
                    "the BERT-Chinese vocabulary (e.g. uer/gpt2-chinese-cluecorpussmall)")
        chat = tokenizer.chat_template == CHAT_TEMPLATE and not args.raw  # an export of a chat stage carries it
        log(f"loaded Hugging Face weights from {args.from_hf}: {'chat template' if chat else 'plain continuation'}")
        return model, tokenizer, chat

    path = args.checkpoint
    if path is None:
        path = find_latest_checkpoint()
        log(f"using {path} (the furthest stage found; pass --checkpoint to choose another)")
    elif not os.path.isdir(path):
        what = f"is a file, not a checkpoint folder; give its folder {os.path.dirname(path) or '.'}" \
            if os.path.isfile(path) else "does not exist; give a directory written by a stage script"
        raise UserError(f"--checkpoint {path} {what}")
    if read_config(path).get("model_type") == "reward":
        raise UserError(f"--checkpoint {path} is a reward model; generate from a pretrain/SFT/PPO/DPO/GRPO checkpoint "
                        f"and pass this one as --reward")
    model, tokenizer, config = load_checkpoint(path, "gpt", flag="--checkpoint")
    merge_lora(model)  # a LoRA stage's adapters added into the weights once: decoding runs at the base's cost
    stage = config.get("stage", "unknown")
    chat = stage in CHAT_STAGES and not args.raw
    log(f"loaded {path} (stage {stage}): {'chat template' if chat else 'plain continuation'}")
    if os.path.isdir(os.path.join(path, "state")):  # what Ctrl-C, --stop_after or --save_every leave mid-run
        from plumbing.records import read_json_or_empty

        saved = read_json_or_empty(os.path.join(path, "state", "trainer_state.json"))
        total = saved.get("settings", {}).get("max_steps")
        log(f"note: {path} is an unfinished run, stopped at step {config.get('step')}"
            f"{f' of {total}' if total else ''}; its stage script's --resume finishes it")
    return model, tokenizer, chat


def check_reward_dir(path: str) -> None:
    """Fail before any loading if ``--reward`` is not a reward model checkpoint."""
    if not os.path.isdir(path):
        raise UserError(f"--reward {path} does not exist; give a directory written by 2-RM.py")
    model_type = read_config(path).get("model_type", "gpt")
    if model_type != "reward":
        raise UserError(f"--reward {path} is a language model, but a reward model is needed; "
                        f"pass a checkpoint written by 2-RM.py")


def load_reward(path: str, vocab_size: int):
    model, _, _ = load_checkpoint(path, "reward", expect_vocab_size=vocab_size, flag="--reward")
    return model


def prompt_to_ids(prompt, tokenizer, chat: bool, context_length: int,
                  bos_id: int | None = None, system: str | None = None) -> list[int]:
    """The model input for ``prompt``: its ids, or ``[CLS] ids [ANS]`` (``[CLS] system [SEP] ids [ANS]`` with a
    ``system`` text), cut from the left to fit the context. A chat ``prompt`` may also be a conversation, a tuple
    of ``(role, content)`` turns ending with a user turn (``read_prompts``).
    A plain continuation starts with ``bos_id`` when the model's documents did in training (``cfg.bos_id``: [CLS]
    for uer's weights); the token stays when the prompt is cut."""
    if not chat:
        start = [] if bos_id is None else [bos_id]
        ids = encode(prompt, tokenizer)
        room = context_length - len(start)
        if len(ids) > room:
            log(f"note: the prompt is {len(ids)} tokens, longer than the {room} that fit in the model's context of "
                f"{context_length}; keeping its last {room}")
            ids = ids[-room:]
        return start + ids
    turns = [("user", prompt)] if isinstance(prompt, str) else list(prompt)  # a conversation from a prompts file
    messages = ([("system", system)] if system and turns[0][0] != "system" else []) + turns
    ids = chat_messages_ids(messages, tokenizer, context_length)  # [CLS] prompt [ANS], cut from its left to fit
    if len(ids) < len(chat_messages_ids(messages, tokenizer)):
        log(f"note: the prompt{' and system text' if system else ''} are longer than the {context_length} tokens "
            f"of the model's context with the chat template; keeping {'the prompt, ' if system else ''}its last "
            f"{len(ids) - 2} tokens")
    return ids


# The weights' precision while generating. fp32 is the default because it was the faster one where it was
# measured: on the CPU bf16 weights halve the bytes a decode step reads, but torch's bf16 matrix-vector products
# are slower than its fp32 ones there (bench/bench_decode.py, bench/README.md); no GPU has been measured yet.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_dtype_argument(p) -> None:
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="precision of the weights while generating (bf16 halves the memory; on the CPU it was "
                        "slower, see bench/README.md)")


def weight_dtype(model) -> str:
    """The dtype the model's weights really have, for the log ("float32", "bfloat16")."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")
