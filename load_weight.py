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
    python load_weight.py --checkpoint checkpoints/ppo --to_gguf FILE.gguf      # language model -> llama.cpp

A LoRA stage's checkpoint (``--lora_rank``: the adapters alone over a base, ``lora.py``) leaves merged, as any
other (the adapters added into the weights), or with ``--peft`` as the base model's export plus a ``peft`` adapter
(``hf_weights.save_peft_adapter``); ``--merge DIR`` writes it as a full stage checkpoint that needs no base.

``--to_gguf FILE`` writes a language model for llama.cpp (``plumbing/gguf_export.py``: GPT-2 or GPT-NeoX in
llama.cpp's terms, our vocabulary as its WordPiece tokenizer, the chat template) and an ollama ``Modelfile`` beside
it (``FILE`` without ``.gguf`` plus ``.Modelfile``); a LoRA checkpoint leaves merged.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile

from chinese_tokenizer import CHAT_TEMPLATE
from gpt_model import RewardModel
from lora import lora_layers, lora_settings, lora_state_dict, merge_lora
from plumbing.checkpoint import (
    CHAT_STAGES,
    check_vocab,
    command_line,
    file_sha256,
    load_checkpoint,
    merge_adapter_checkpoint,
    replace_dir,
    save_checkpoint,
)
from plumbing.cli import ArgumentParser, UserError, default_path, run
from plumbing.gguf_export import GGUF_TYPES, modelfile, modelfile_path, save_gguf, temporary_beside
from plumbing.hf_weights import hf_weight_files, import_tokenizer, load_hf_model, save_hf_model, save_peft_adapter

EXAMPLES = """examples:
  # export the aligned model for transformers (GPT-NeoX for the demo's rotary positions; chat template included)
  python load_weight.py --checkpoint checkpoints/ppo --to_hf hf/ppo
  #   then: AutoTokenizer.from_pretrained("hf/ppo"), AutoModelForCausalLM.from_pretrained("hf/ppo")

  # a LoRA checkpoint (1-SFT.py --lora_rank 8): as a peft adapter over its base, or merged into one checkpoint
  python load_weight.py --checkpoint checkpoints/sft-lora --to_hf hf/sft-lora --peft
  #   then: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("hf/sft-lora/base"), "hf/sft-lora/adapter")
  python load_weight.py --checkpoint checkpoints/sft-lora --merge checkpoints/sft-merged

  # export the reward model: AutoModelForSequenceClassification (one score per text, read at its last token)
  python load_weight.py --checkpoint checkpoints/rm --to_hf hf/rm

  # the aligned model for llama.cpp and ollama: one GGUF file (f32, f16 or q8_0) and an ollama Modelfile beside it
  python load_weight.py --checkpoint checkpoints/ppo --to_gguf gguf/ppo.gguf --gguf_type q8_0
  #   then: llama-cli -m gguf/ppo.gguf --jinja -cnv, or ollama create ppo -f gguf/ppo.Modelfile

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
                        help="stage checkpoint to export, a language or a reward model (needs --to_hf, --to_gguf "
                             "or --merge)")
    p.add_argument("--to_checkpoint", metavar="DIR", default=default_path("checkpoints", "hf-init"),
                   help="where --from_hf writes the stage checkpoint (default: %(default)s)")
    p.add_argument("--to_hf", metavar="DIR", help="where --checkpoint writes the Hugging Face directory")
    p.add_argument("--to_gguf", metavar="FILE",
                   help="where --checkpoint writes a language model as one GGUF file for llama.cpp, with an ollama "
                        "Modelfile beside it")
    p.add_argument("--gguf_type", choices=GGUF_TYPES,
                   help="number format of the GGUF file's matrices (default: f32; f16 is half its size, q8_0, whose "
                        "output head stays f16, about a third)")
    p.add_argument("--peft", action="store_true",
                   help="with --to_hf and a LoRA checkpoint: write the base model to DIR/base and the adapters as a "
                        "peft adapter to DIR/adapter, instead of one model with the adapters merged in")
    p.add_argument("--merge", metavar="DIR",
                   help="with --checkpoint of a LoRA stage: write its base with the adapters merged in as a full "
                        "stage checkpoint at DIR (one that loads without the base)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer for --from_hf (default: the HF directory's own vocab.txt if it is the "
                        "bert-base-chinese vocabulary, else data/tokenizer)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (a directory, or the GGUF file and its Modelfile)")
    args = p.parse_args(argv)
    outputs = [flag for flag in ("to_hf", "to_gguf", "merge") if getattr(args, flag)]
    if args.checkpoint and not outputs:
        p.error("--checkpoint needs --to_hf DIR (a Hugging Face directory), --to_gguf FILE (llama.cpp) or --merge DIR")
    if len(outputs) > 1:
        p.error(f"{' and '.join('--' + f for f in outputs)} are different outputs; give one of them")
    if args.peft and args.to_gguf:
        p.error("--peft writes the adapters unmerged for transformers; llama.cpp gets them merged into the weights: "
                "drop --peft")
    if args.peft and not args.to_hf:
        p.error("--peft goes with --checkpoint and --to_hf")
    if args.from_hf and (args.to_hf or args.to_gguf):
        p.error("--to_hf and --to_gguf go with --checkpoint; with --from_hf use --to_checkpoint")
    if args.gguf_type and not args.to_gguf:
        p.error("--gguf_type goes with --to_gguf")
    if args.to_gguf and not args.to_gguf.endswith(".gguf"):
        p.error(f"--to_gguf {args.to_gguf}: name the file NAME.gguf (its ollama Modelfile goes beside it as "
                f"NAME.Modelfile)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        merge_adapter_checkpoint(args.checkpoint, args.merge, args.overwrite)
        print(f"wrote {args.merge}: {args.checkpoint}'s adapters merged into its base, a full checkpoint")
        return 0
    if args.to_gguf:
        return export_gguf(args)
    if args.checkpoint:
        if os.path.exists(args.to_hf) and not args.overwrite:
            raise UserError(f"--to_hf {args.to_hf} already exists; pass --overwrite to replace it, or choose another "
                            f"directory")
        model, tokenizer, config = load_checkpoint(args.checkpoint, flag="--checkpoint")
        chat = config.get("stage") in CHAT_STAGES
        if args.peft:
            return export_peft(args, model, tokenizer, config, chat)
        merge_lora(model)  # a LoRA checkpoint leaves as one model, the adapters added into the weights
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


def export_gguf(args) -> int:
    """``--to_gguf FILE``: a language model checkpoint as one GGUF file (``gguf_export.save_gguf``; a LoRA
    checkpoint merged first) and its ollama ``Modelfile`` beside it. ``UserError`` for what llama.cpp cannot run
    and for an existing output without ``--overwrite``."""
    path, recipe, gguf_type = args.to_gguf, modelfile_path(args.to_gguf), args.gguf_type or "f32"
    if os.path.exists(recipe) and not args.overwrite:
        raise UserError(f"{recipe} (the ollama Modelfile written beside --to_gguf) already exists; pass --overwrite "
                        f"to replace it, or choose another file")
    model, tokenizer, config = load_checkpoint(args.checkpoint, flag="--checkpoint")
    chat = config.get("stage") in CHAT_STAGES
    merge_lora(model)
    name = os.path.basename(os.path.normpath(args.checkpoint))
    arch = save_gguf(model, path, tokenizer, gguf_type, chat=chat, name=name, overwrite=args.overwrite)
    tmp = temporary_beside(recipe)  # the folder was just written to
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(modelfile(path, chat, model.cfg.context_length))
    os.replace(tmp, recipe)
    size = os.path.getsize(path) / 1e6
    print(f"wrote {path} ({arch} in llama.cpp's terms, {gguf_type}, {size:.1f} MB"
          f"{', with the chat template' if chat else ''}) and {recipe}: llama-cli -m {path}"
          f"{' --jinja -cnv' if chat else ''}, or ollama create {name} -f {recipe}")
    return 0


def export_peft(args, model, tokenizer, config, chat: bool) -> int:
    """``--to_hf DIR --peft``: a LoRA checkpoint as DIR/base (its base model, exported as any checkpoint) and
    DIR/adapter (the adapters as ``peft`` writes them, ``hf_weights.save_peft_adapter``), both built in a temporary
    sibling that is renamed into place. ``UserError`` when the checkpoint has no adapters."""
    if "lora" not in config:
        raise UserError(f"--peft: --checkpoint {args.checkpoint} has no LoRA adapters (its stage ran without "
                        f"--lora_rank); export it without --peft")
    settings, adapters = lora_settings(model), lora_state_dict(model)
    base = copy.deepcopy(model)
    for layer in lora_layers(base):
        layer.lora_B.data.zero_()  # B = 0: the update is exactly zero, so merging leaves the base weights as they are
    merge_lora(base)
    parent = os.path.dirname(os.path.abspath(args.to_hf))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(args.to_hf)}.tmp-", dir=parent)
    try:
        # peft (AutoPeftModelForCausalLM) loads the base from this path as given: absolute, so from any folder
        save_peft_adapter(model.cfg, settings, adapters, os.path.join(tmp, "adapter"),
                          base_model_name_or_path=os.path.join(os.path.abspath(args.to_hf), "base"))
        written = save_hf_model(base, os.path.join(tmp, "base"), tokenizer, chat=chat)
        replace_dir(tmp, args.to_hf)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {args.to_hf}/base ({written}) and {args.to_hf}/adapter (a peft adapter, rank {settings['rank']}, "
          f"{', '.join(settings['targets'])}): PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
          f"'{args.to_hf}/base'), '{args.to_hf}/adapter') loads them")
    return 0


if __name__ == "__main__":
    run(main)
