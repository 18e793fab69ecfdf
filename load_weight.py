"""Weights in and out on the command line: a Hugging Face directory -> a stage checkpoint, and a stage checkpoint
(language model or reward model) -> a directory that ``transformers`` loads with its ``Auto*`` classes.

Each configuration leaves as the ``transformers`` architecture that computes the same function: LayerNorm +
learned positions as GPT-2, LayerNorm + rotary positions (the demo) as GPT-NeoX, RMSNorm + rotary as Arcee; a
reward model as that architecture's ``*ForSequenceClassification``. The mapping itself (names, transposes, the
rotary row order, the checks that refuse what has no equivalent) is in ``plumbing/hf_weights.py``, which
``0-PRETRAIN.py --init_from_hf`` and ``generate.py --from_hf`` use too.

Command line (see ``--help``)::

    python load_weight.py --from_hf DIR --to_checkpoint checkpoints/hf-init     # HF directory -> stage checkpoint
    python load_weight.py --checkpoint checkpoints/ppo --to_hf DIR              # stage checkpoint -> HF directory
"""

from __future__ import annotations

import argparse
import os

from chinese_tokenizer import CHAT_TEMPLATE
from gpt_model import RewardModel
from plumbing.checkpoint import (
    CHAT_STAGES,
    check_vocab,
    command_line,
    file_sha256,
    load_checkpoint,
    save_checkpoint,
)
from plumbing.cli import ArgumentParser, UserError, default_path, run
from plumbing.hf_weights import hf_weight_files, import_tokenizer, load_hf_model, save_hf_model

EXAMPLES = """examples:
  # export the aligned model for transformers (GPT-NeoX for the demo's rotary positions; chat template included)
  python load_weight.py --checkpoint checkpoints/ppo --to_hf hf/ppo
  #   then: AutoTokenizer.from_pretrained("hf/ppo"), AutoModelForCausalLM.from_pretrained("hf/ppo")

  # export the reward model: AutoModelForSequenceClassification (one score per text, read at its last token)
  python load_weight.py --checkpoint checkpoints/rm --to_hf hf/rm

  # import a Hugging Face directory (GPT-2, GPT-NeoX or Arcee, LM or reward model) as a stage checkpoint
  python load_weight.py --from_hf DIR --to_checkpoint checkpoints/hf-init

  # the real uer/gpt2-chinese-cluecorpussmall (12 layers x 768, 1024 positions, our vocabulary):
  #   on a machine with network
  hf download uer/gpt2-chinese-cluecorpussmall --local-dir hf/uer-gpt2-chinese
  #   then, with that directory here (no network needed), continue pretraining from it
  python 0-PRETRAIN.py --init_from_hf hf/uer-gpt2-chinese --preset uer-gpt2-chinese  # --context_length 256 on a CPU
  #   or first make a checkpoint of it, e.g. for 1-SFT.py --init checkpoints/hf-init
  python load_weight.py --from_hf hf/uer-gpt2-chinese --to_checkpoint checkpoints/hf-init
"""


def parse_args(argv=None):
    p = ArgumentParser(
        description="Convert weights between Hugging Face directories (GPT-2, GPT-NeoX, Arcee; language or "
                    "reward models) and this project's stage checkpoints.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from_hf", metavar="DIR", help="local Hugging Face directory to import")
    source.add_argument("--checkpoint", metavar="DIR",
                        help="stage checkpoint to export, a language or a reward model (needs --to_hf)")
    p.add_argument("--to_checkpoint", metavar="DIR", default=default_path("checkpoints", "hf-init"),
                   help="where --from_hf writes the stage checkpoint (default: %(default)s)")
    p.add_argument("--to_hf", metavar="DIR", help="where --checkpoint writes the Hugging Face directory")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer for --from_hf (default: the HF directory's own vocab.txt if it is the "
                        "bert-base-chinese vocabulary, else data/tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    if args.checkpoint and not args.to_hf:
        p.error("--checkpoint needs --to_hf DIR (where to write the Hugging Face directory)")
    if args.from_hf and args.to_hf:
        p.error("--to_hf goes with --checkpoint; with --from_hf use --to_checkpoint")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.checkpoint:
        if os.path.exists(args.to_hf) and not args.overwrite:
            raise UserError(f"--to_hf {args.to_hf} already exists; pass --overwrite to replace it, or choose another "
                            f"directory")
        model, tokenizer, config = load_checkpoint(args.checkpoint, flag="--checkpoint")
        chat = config.get("stage") in CHAT_STAGES
        written = save_hf_model(model, args.to_hf, tokenizer, overwrite=args.overwrite, chat=chat)
        auto = "AutoModelForSequenceClassification" if "Classification" in written else "AutoModelForCausalLM"
        print(f"wrote {args.to_hf} as {written}: {auto}.from_pretrained and AutoTokenizer.from_pretrained load it"
              f"{' (the tokenizer has the chat template)' if chat else ''}")
        return 0

    if os.path.exists(args.to_checkpoint) and not args.overwrite:
        raise UserError(f"--to_checkpoint {args.to_checkpoint} already exists; pass --overwrite to replace it or "
                        f"choose another directory")
    model = load_hf_model(args.from_hf)
    tokenizer = import_tokenizer(args.from_hf, args.tokenizer)
    check_vocab(tokenizer, model.cfg.vocab_size, f"--from_hf {args.from_hf}", "stage checkpoints need the 21128-id "
                "Chinese vocabulary (e.g. uer/gpt2-chinese-cluecorpussmall), not OpenAI's BPE")
    files = hf_weight_files(args.from_hf)
    # an export of a chat stage (its tokenizer has our template) stays a chat model; reward models always read it
    chat = tokenizer.chat_template == CHAT_TEMPLATE and not isinstance(model, RewardModel)
    meta = {"stage": "hf-import-chat" if chat else "hf-import", "parent": os.path.abspath(args.from_hf),
            "parent_sha256": file_sha256(files[0]) if len(files) == 1 else None,
            "step": 0, "tokens_seen": 0, "metrics": {}, "command": command_line()}
    save_checkpoint(args.to_checkpoint, model, tokenizer, meta)
    n_params = sum(p.numel() for p in model.parameters())
    kind = "a reward model, e.g. for --reward" if isinstance(model, RewardModel) else "continue with --init"
    print(f"wrote {args.to_checkpoint} ({n_params:,} parameters, {model.cfg.n_layers} layers x {model.cfg.emb_dim}, "
          f"context {model.cfg.context_length}); {kind} {args.to_checkpoint}")
    return 0


if __name__ == "__main__":
    run(main)
