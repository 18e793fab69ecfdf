"""Stage checkpoints: the hand-off between stages.

A checkpoint is a directory::

    model.safetensors   weights only (no pickle, so loading can never run code)
    config.json         {"model": GPTConfig fields, "model_type": "gpt" | "reward", "stage", "parent",
                         "parent_sha256", "step", "tokens_seen", "metrics", "command", ...}
    tokenizer/          the tokenizer, saved with ``save_pretrained``
    metrics.jsonl, *.png   written by the stage
    state/              while training: optimizer, RNG and step, for ``--resume`` (see ``training.py``)

A model with LoRA adapters (``lora.py``) is saved as an adapter checkpoint: ``adapter.safetensors`` (the adapter
tensors alone) instead of ``model.safetensors``, and ``config.json`` adds ``"lora"`` (rank, alpha, targets,
dropout) and the base checkpoint it adapts: ``"base"`` (absolute path), ``"base_relative"`` (from the adapter's
directory) and ``"base_sha256"`` (of the base's weights file). ``load_checkpoint`` reads either kind.

Every write goes to a temporary sibling directory that is renamed into place, so an interrupted save never leaves
a half-written checkpoint where the old one was. An existing checkpoint is replaced only when the user asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from chinese_tokenizer import load_tokenizer
from gpt_model import GPTConfig, GPTModel, RewardModel, unwrap_compiled
from lora import add_lora, has_lora, load_lora_state_dict, lora_settings, lora_state_dict, merge_lora
from plumbing.cli import UserError

MODEL_FILE, CONFIG_FILE, TOKENIZER_DIR, STATE_DIR = "model.safetensors", "config.json", "tokenizer", "state"
ADAPTER_FILE = "adapter.safetensors"  # an adapter checkpoint's weights: the LoRA tensors alone
MODEL_TYPES = {"gpt": GPTModel, "reward": RewardModel}
# the stages whose checkpoints were trained on the chat template; "hf-import-chat" is an import (load_weight.py
# --from_hf) of a model exported from one of them, whose tokenizer carries the chat template
CHAT_STAGES = ("sft", "ppo", "dpo", "grpo", "hf-import-chat")


def check_output_dir(output_dir: str, overwrite: bool, resume: bool, flag: str = "--output_dir") -> None:
    """Fail early, before any work, if ``output_dir`` holds a checkpoint the user did not say to replace or resume.
    ``flag`` is the argument the messages name (``load_weight.py --merge``, say).

    Raises:
        UserError: it exists without ``--overwrite``/``--resume``, or ``--resume`` finds no saved state.
    """
    exists = os.path.exists(os.path.join(output_dir, CONFIG_FILE))
    resumable = os.path.isdir(os.path.join(output_dir, STATE_DIR))
    if resume:
        if not resumable:
            finished = " (it holds a finished checkpoint: pass --overwrite instead to train it again)" if exists else ""
            raise UserError(f"--resume: no saved training state in {output_dir}/{STATE_DIR}{finished}; "
                            f"drop --resume to start a new run")
        return
    if exists and not overwrite:
        resume_it = "--resume to continue its saved state, " if resumable else ""
        raise UserError(f"{output_dir} already holds a checkpoint; pass --overwrite to replace it, {resume_it}"
                        f"or choose another {flag}")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"{flag} {output_dir} is a file; choose a directory path")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_file(path: str) -> str:
    """The file that holds checkpoint ``path``'s own weights: ``adapter.safetensors`` in an adapter checkpoint,
    else ``model.safetensors`` (whether or not it exists)."""
    adapter = os.path.join(path, ADAPTER_FILE)
    return adapter if os.path.isfile(adapter) else os.path.join(path, MODEL_FILE)


def save_checkpoint(output_dir: str, model, tokenizer, meta: dict, write_state=None, extra_files=None,
                    carry=()) -> None:
    """Write a stage checkpoint atomically: build it in a temporary sibling directory, then rename it into place.

    Args:
        model: a ``GPTModel`` or ``RewardModel`` (unwrapped from Accelerate; a ``torch.compile`` wrapper, which
            ``accelerate launch --dynamo_backend inductor`` leaves on, is taken off here). With LoRA adapters the
            adapters alone are written, over the base that ``adapter_meta`` reads from ``meta``.
        tokenizer: saved into ``tokenizer/``.
        meta: stage metadata merged into ``config.json`` (stage, parent, step, metrics, ...).
        write_state: optional ``fn(state_dir)`` writing the resumable training state into ``state/``.
        extra_files: optional {file name: fn(path)} writers for the stage's own files (metrics.jsonl, plots).
        carry: names of entries of the old ``output_dir`` moved into the new one (``replace_dir``): files another
            writer keeps open there, such as the TensorBoard event files (``training.Curves``).
    Raises:
        UserError: the disk is full or the directory is not writable; the previous checkpoint is left intact.
    """
    model = unwrap_compiled(model)
    model_type = next(name for name, cls in MODEL_TYPES.items() if isinstance(model, cls))
    adapter = has_lora(model)
    if adapter:
        meta = {**meta, **adapter_meta(model, meta, output_dir)}
    parent = os.path.dirname(os.path.abspath(output_dir))
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.tmp-", dir=parent)
        if adapter:
            save_file(lora_state_dict(model), os.path.join(tmp, ADAPTER_FILE))
        else:
            save_model(model, os.path.join(tmp, MODEL_FILE))  # handles the tied embedding/head weights
        config = {"model": model.cfg.to_dict(), "model_type": model_type, **meta}
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
        tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER_DIR))
        for name, write in (extra_files or {}).items():
            write(os.path.join(tmp, name))
        if write_state is not None:
            write_state(os.path.join(tmp, STATE_DIR))
        replace_dir(tmp, output_dir, carry)
    except OSError as e:
        raise UserError(f"could not write checkpoint {output_dir}: {e.strerror or e}; free some disk space or "
                        f"choose another --output_dir (the previous checkpoint is unchanged)") from e
    finally:
        if tmp is not None and os.path.exists(tmp):  # a failed or interrupted write leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(new: str, target: str, carry=()) -> None:
    """Put directory ``new`` at ``target``; an old ``target`` is moved aside first and removed only afterwards,
    once the entries named in ``carry`` that it holds (and ``new`` does not) are moved into the new ``target``: a
    rename on one file system, so a file some writer holds open stays the file it writes to.

    ``new`` and everything in it first get the modes the user's umask gives new files: ``mkdtemp`` makes the
    directory private and safetensors writes its files 0600, but a checkpoint is an output like any other."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(new, 0o777 & ~mask)
    for root, dirs, files in os.walk(new):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)
    old = None
    if os.path.exists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(os.path.abspath(target)))
        os.rmdir(old)
        os.rename(target, old)
    os.rename(new, target)
    if old is not None:
        for name in carry:
            if os.path.exists(os.path.join(old, name)) and not os.path.exists(os.path.join(target, name)):
                os.rename(os.path.join(old, name), os.path.join(target, name))
        shutil.rmtree(old, ignore_errors=True)


def check_vocab(tokenizer, vocab_size: int, source: str, fix: str) -> None:
    """Raise ``UserError`` unless ``tokenizer`` has exactly ``vocab_size`` ids: every id must name one row of the
    model's embedding and one column of its logits. ``source`` names the model's origin, ``fix`` the remedy."""
    if len(tokenizer) != vocab_size:
        raise UserError(f"{source}: the tokenizer has {len(tokenizer)} ids but the model's vocab_size is "
                        f"{vocab_size}; {fix}")


def read_config(path: str) -> dict:
    """The ``config.json`` of checkpoint ``path``. Raises ``UserError`` if it is missing or unreadable."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise UserError(f"no checkpoint at {path} (missing {CONFIG_FILE}); run the stage that writes it first, "
                        f"or point to another directory")
    try:
        with open(config_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{config_path} is not valid JSON ({e}); the checkpoint is damaged, re-run its stage") from e


def load_checkpoint(path: str, model_type: str | None = None, expect_vocab_size: int | None = None, flag: str = ""):
    """Load a stage checkpoint: ``(model, tokenizer, config)``, the model in eval mode on the CPU.

    An adapter checkpoint (a LoRA stage's) gives its base with the adapters on, unmerged (``load_adapter``): a
    model with ``lora.LoRALinear`` layers, frozen but for the adapters; ``lora.merge_lora`` makes it a plain one.

    Args:
        model_type: "gpt" (a language model: pretrain, SFT or PPO) or "reward" to insist on one; "backbone" takes
            either and returns the ``GPTModel`` (a reward model's backbone); None returns what was saved.
        expect_vocab_size: fail if the checkpoint's vocabulary differs.
        flag: the command-line flag that named ``path`` (e.g. "--reward"), for the wrong-kind message.
    Raises:
        UserError: missing or damaged files, the wrong kind of model, weights that do not fit the config, or an
            adapter whose base is missing or differs.
    """
    where = f"{flag} {path}" if flag else path
    config = read_config(path)
    if "model" not in config and "architectures" in config:
        raise UserError(f"{where} is a Hugging Face directory, not a checkpoint of this project; read it with "
                        f"--from_hf {path} (generate.py, load_weight.py) or --init_from_hf (0-PRETRAIN.py)")
    try:
        cfg = GPTConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}/{CONFIG_FILE} has no valid model config ({e}); re-run the stage that wrote it") from e
    if expect_vocab_size is not None and cfg.vocab_size != expect_vocab_size:
        raise UserError(f"checkpoint {path} has vocab_size {cfg.vocab_size} but this run uses {expect_vocab_size}; "
                        f"use a checkpoint trained with the same tokenizer")
    saved_type = config.get("model_type", "gpt")
    if model_type == "reward" and saved_type != "reward":
        raise UserError(f"{where} is a language model, but a reward model is needed; "
                        f"pass a checkpoint written by 2-RM.py")
    if model_type == "gpt" and saved_type == "reward":
        raise UserError(f"{where} is a reward model, but a language model is needed here; pass a checkpoint "
                        f"written by 0-PRETRAIN.py, 1-SFT.py or an alignment stage (3-PPO.py, 3-DPO.py, 3-GRPO.py)")
    if "lora" in config:  # an adapter checkpoint (a LoRA stage's): its base, checked by hash, plus the adapter
        model = load_adapter(path, config, cfg, saved_type)
    else:
        model = MODEL_TYPES[saved_type](cfg)
        load_full_weights(model, path)
    if model_type == "backbone" and saved_type == "reward":
        model = model.backbone
    tokenizer = load_tokenizer(os.path.join(path, TOKENIZER_DIR))
    check_vocab(tokenizer, cfg.vocab_size, f"checkpoint {path}", "the checkpoint is inconsistent; re-run its stage")
    model.eval()
    return model, tokenizer, config


def load_full_weights(model, path: str) -> None:
    """Fill ``model`` with the weights in checkpoint ``path``'s ``model.safetensors``.

    Raises:
        UserError: the file is missing or damaged, or its tensors do not fit the model.
    """
    weights = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(weights):
        raise UserError(f"no {MODEL_FILE} in {path}; the checkpoint is incomplete, re-run its stage")
    try:
        missing, unexpected = load_model(model, weights, strict=False)
    except (SafetensorError, RuntimeError, OSError) as e:
        raise UserError(f"{weights} does not fit its config ({str(e).splitlines()[0]}); "
                        f"the checkpoint is damaged or from another architecture") from e
    if missing or unexpected:
        raise UserError(f"{weights} does not match the architecture in its config.json (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}); re-run the stage that wrote it")


def adapter_meta(model, meta: dict, output_dir: str) -> dict:
    """What an adapter checkpoint's ``config.json`` records besides the stage's ``meta``: ``"lora"`` (the settings)
    and the base: ``"base"`` (absolute path), ``"base_relative"`` (the path from ``output_dir``) and
    ``"base_sha256"`` (of the base's weights file, ``weights_file``).

    The base is ``meta["base"]`` when the stage names one, else the stage's parent (``meta["parent"]``, the
    checkpoint it loaded before adding adapters); its sha256 is ``meta``'s ``*_sha256`` when given (as
    ``parent_meta`` computes it when the parent is loaded), else computed now.

    Raises:
        ValueError: ``meta`` names no base (a stage's mistake, not a user's).
    """
    key = "base" if "base" in meta else "parent"
    if not meta.get(key):
        raise ValueError("a model with LoRA adapters is saved as an adapter over its base: give save_checkpoint's "
                         "meta a 'parent' (parent_meta) or a 'base'")
    base = os.path.abspath(meta[key])
    return {"lora": lora_settings(model), "base": base,
            "base_relative": os.path.relpath(base, os.path.abspath(output_dir)),
            "base_sha256": meta.get(f"{key}_sha256") or file_sha256(weights_file(base))}


def find_base(path: str, config: dict) -> str:
    """The base checkpoint of adapter checkpoint ``path``: the first of its recorded places whose weights file has
    the recorded sha256 (``config["base_sha256"]``).

    The places, in order: ``config["base"]``, the absolute path the stage saw (a relative one, written by hand, is
    read from the current directory), then ``config["base_relative"]`` joined to ``path``. So an adapter keeps
    working when its base stays where it was, and when the two move together (a copied ``checkpoints/`` folder);
    the hash makes sure that whichever is found is the very base the adapter was trained on.

    Raises:
        UserError: one line naming the adapter checkpoint and the base, and the fix: no base at either place, or
            a base whose weights differ.
    """
    places = [config.get("base")]
    if config.get("base_relative"):
        places.append(os.path.normpath(os.path.join(path, config["base_relative"])))
    found = [p for p in dict.fromkeys(places) if p and os.path.isfile(weights_file(p))]
    for base in found:
        if file_sha256(weights_file(base)) == config.get("base_sha256"):
            return base
    if not found:
        raise UserError(f"adapter checkpoint {path}: its base checkpoint {places[0]} is not there; put the base back "
                        f"(or set \"base\" in {os.path.join(path, CONFIG_FILE)}) or retrain the adapter")
    raise UserError(f"adapter checkpoint {path} was trained on another base than {found[0]} (the sha256 of "
                    f"{os.path.basename(weights_file(found[0]))} differs); point \"base\" in "
                    f"{os.path.join(path, CONFIG_FILE)} to the base it was trained on, or retrain the adapter")


def load_adapter(path: str, config: dict, cfg: GPTConfig, saved_type: str):
    """The model of adapter checkpoint ``path``: its base (``find_base``, read with ``load_checkpoint``) with adapters
    added as ``config["lora"]`` says (``lora.add_lora``) and ``adapter.safetensors`` loaded into them.

    A base that is itself an adapter checkpoint (a LoRA stage after a LoRA stage) has its own adapters merged
    first, as ``load_backbone`` merged them for the stage that trained this adapter.

    Raises:
        UserError: the base is missing or differs (``find_base``), or the adapter does not fit it.
    """
    base = find_base(path, config)
    model, _, _ = load_checkpoint(base, "reward" if saved_type == "reward" else "backbone")
    if model.cfg != cfg:
        raise UserError(f"adapter checkpoint {path} records another model config than its base {base}; "
                        f"the checkpoint is damaged, re-run its stage")
    if has_lora(model):
        merge_lora(model)
    settings, adapter = config["lora"], os.path.join(path, ADAPTER_FILE)
    try:
        add_lora(model, settings["rank"], settings["alpha"], settings["targets"], settings.get("dropout", 0.0))
        load_lora_state_dict(model, load_file(adapter))
    except (KeyError, TypeError, ValueError, SafetensorError, OSError) as e:
        raise UserError(f"{adapter} does not fit its base {base} ({str(e).splitlines()[0]}); "
                        f"the checkpoint is damaged, re-run its stage") from e
    return model


def merge_adapter_checkpoint(src: str, dst: str, overwrite: bool = False) -> None:
    """Write adapter checkpoint ``src`` as a full checkpoint at ``dst``: its base with the adapters merged into the
    weights (``lora.merge_lora``), which loads without the base. ``config.json`` keeps ``src``'s metadata (stage,
    parent, metrics, ...) and records what was merged under ``"merged_from"`` (the adapter, its base, both
    sha256s, the LoRA settings).

    Raises:
        UserError: ``src`` is not an adapter checkpoint, its base is missing or differs, or ``dst`` holds a
            checkpoint and ``overwrite`` is false.
    """
    check_output_dir(dst, overwrite, resume=False, flag="--merge")
    if "lora" not in read_config(src):
        raise UserError(f"{src} is not an adapter checkpoint (no {ADAPTER_FILE}): it is a full checkpoint already")
    model, tokenizer, config = load_checkpoint(src)
    merge_lora(model)
    merged_from = {"adapter": os.path.abspath(src), "adapter_sha256": file_sha256(os.path.join(src, ADAPTER_FILE)),
                   "base": config["base"], "base_sha256": config["base_sha256"], "lora": config["lora"]}
    dropped = ("model", "model_type", "lora", "base", "base_relative", "base_sha256")
    meta = {**{k: v for k, v in config.items() if k not in dropped}, "merged_from": merged_from}
    save_checkpoint(dst, model, tokenizer, meta)


def load_weights_into(model, path: str) -> None:
    """Copy the weights of checkpoint ``path`` into ``model`` (same architecture), e.g. to initialise a stage from
    its parent. A reward checkpoint's backbone fills a ``GPTModel``.

    Raises:
        UserError: the architectures differ, or the LoRA adapters (their settings, or whether there are any); the
            message names both sides.
    """
    source, _, config = load_checkpoint(path, "backbone" if isinstance(model, GPTModel) else None)
    if source.cfg != model.cfg:
        diff = {k: (v, model.cfg.to_dict()[k]) for k, v in source.cfg.to_dict().items() if model.cfg.to_dict()[k] != v}
        raise UserError(f"checkpoint {path} has another architecture than this run (checkpoint vs run: {diff}); "
                        f"use --preset matching the checkpoint or omit the size flags")
    saved, run = (lora_settings(m) if has_lora(m) else "none" for m in (source, model))
    if saved != run:
        raise UserError(f"checkpoint {path} has LoRA adapters {saved}, this run {run}; pass the same --lora_rank, "
                        f"--lora_alpha and --lora_targets as the run that wrote it")
    model.load_state_dict(source.state_dict())


def load_backbone(path: str, flag: str, tokenizer, written_by: str, kind: str = "gpt"):
    """The language model a stage starts from: checkpoint ``path``'s ``GPTModel`` in train mode, and what the new
    checkpoint records about its parent (``parent_meta``). An adapter checkpoint's adapters are merged into the
    weights (``lora.merge_lora``): a stage always starts from a plain model, every parameter trainable, and may add
    adapters of its own.

    Args:
        flag: the command-line flag that named ``path``, and ``written_by`` the script that writes such a
            checkpoint (both for the error message).
        tokenizer: the run's tokenizer; the checkpoint's vocabulary must match it.
        kind: "gpt" takes a language model only (pretrain, SFT, PPO); "backbone" also takes a reward model's
            backbone (the RM may start from SFT or from another RM).
    Raises:
        UserError: no checkpoint at ``path``, the wrong kind, damaged files, or another vocabulary.
    """
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise UserError(f"{flag} {path}: no checkpoint there (missing {CONFIG_FILE}); run `python {written_by}` "
                        f"first, or pass {flag} DIR")
    model, _, _ = load_checkpoint(path, kind, expect_vocab_size=len(tokenizer), flag=flag)
    merge_lora(model)
    model.train()
    return model, parent_meta(path)


def parent_meta(path: str, name: str = "parent") -> dict:
    """What a child checkpoint records about a checkpoint it was trained from: ``{name: path, name_sha256: the sha256
    of its weights file, ``weights_file``}`` (``name`` "parent" for the model it starts from, "reward" for PPO's and
    GRPO's reward model)."""
    weights = weights_file(path)
    return {name: os.path.abspath(path), f"{name}_sha256": file_sha256(weights) if os.path.isfile(weights) else None}


def command_line() -> str:
    """This process's command line as a shell would take it back (arguments with spaces quoted)."""
    return shlex.join([os.path.basename(sys.executable)] + sys.argv)


def load_pickle_free(path: str):
    """Read a ``.bin``/``.pt`` tensor file without running code: ``torch.load(weights_only=True)``.

    Raises:
        UserError: the file holds objects other than tensors (a pickle that could run code is refused).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError or RuntimeError with a long explanation
        raise UserError(f"refusing to load {path}: it is not a plain tensor file ({type(e).__name__}); "
                        f"convert it to safetensors from a trusted source") from e


def weights_digest(*models) -> str:
    """The sha256 of every parameter and buffer of ``models`` (names, dtypes, shapes and bytes), in order; a tensor
    seen already (a tied head) adds only its name."""
    h, seen = hashlib.sha256(), set()
    for model in models:
        for name, t in model.state_dict().items():
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.numel() and (t.data_ptr(), t.dtype, t.shape) not in seen:
                seen.add((t.data_ptr(), t.dtype, t.shape))
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()
