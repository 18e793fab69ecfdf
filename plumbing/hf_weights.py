"""Public GPT-2 weights in and out: Hugging Face GPT-2 directories <-> our ``GPTModel``.

In: ``load_hf_gpt2(path)`` reads a local directory in the Hugging Face ``transformers`` GPT-2 format (``config.json``
plus ``model.safetensors`` or ``pytorch_model.bin``), for example uer/gpt2-chinese-cluecorpussmall (the Chinese
GPT-2 whose vocabulary is ours, id for id) or OpenAI's gpt2, and returns a ``GPTModel`` with the same outputs.
Out: ``save_hf_gpt2(model, out_dir, tokenizer)`` writes a directory that ``transformers.GPT2LMHeadModel`` and
``AutoTokenizer`` load with ``from_pretrained``.

The two models compute the same function; only the storage differs (``transformers/models/gpt2/modeling_gpt2.py``):

* OpenAI's GPT-2 code, and ``transformers`` after it, stores every projection as a ``Conv1D``: ``y = x @ W + b`` with
  ``W`` of shape (in, out). Our ``nn.Linear`` computes ``y = x @ W.T + b`` with ``W`` of shape (out, in), so every
  projection matrix is transposed on the way in and on the way out.
* Attention projects queries, keys and values with one fused ``c_attn`` of width 3E, in that order; we keep three
  separate ``W_query``/``W_key``/``W_value`` (the walkthrough's names), so ``c_attn`` is cut into three E-wide thirds.
* ``attn.bias`` and ``attn.masked_bias`` in older files are not weights but the causal mask and its fill value,
  stored as buffers; our attention builds its mask itself, so they are skipped.
* With ``tie_word_embeddings`` (the default, and what GPT-2 and uer use) the output head is the token embedding
  matrix; a file may carry a copy as ``lm_head.weight``, which, like ``transformers``, we ignore.

Name map (i = block index; E = n_embd)::

    wte.weight                 (V, E)       tok_emb.weight
    wpe.weight                 (T, E)       pos_emb.weight
    h.i.ln_1.weight / .bias    (E,)         trf_blocks.i.norm1.scale / .shift
    h.i.attn.c_attn.weight     (E, 3E)      trf_blocks.i.att.W_query / W_key / W_value .weight   (E, E) each, transposed
    h.i.attn.c_attn.bias       (3E,)        trf_blocks.i.att.W_query / W_key / W_value .bias     (E,) each
    h.i.attn.c_proj.weight     (E, E)       trf_blocks.i.att.out_proj.weight                     transposed
    h.i.ln_2.weight / .bias    (E,)         trf_blocks.i.norm2.scale / .shift
    h.i.mlp.c_fc.weight        (E, 4E)      trf_blocks.i.ff.layers.0.weight      (4E, E)         transposed
    h.i.mlp.c_proj.weight      (4E, E)      trf_blocks.i.ff.layers.2.weight      (E, 4E)         transposed
    ln_f.weight / .bias        (E,)         final_norm.scale / .shift
    lm_head.weight             (V, E)       out_head.weight (only when the embeddings are not tied)

Keys appear either as ``transformer.h.0...`` (saved from ``GPT2LMHeadModel``, e.g. uer) or as bare ``h.0...`` (saved
from ``GPT2Model``, e.g. OpenAI's gpt2 ``model.safetensors``); both load.

Config fields read from ``config.json`` (a missing one takes ``transformers.GPT2Config``'s default):
``n_positions`` -> ``context_length``, ``n_embd`` -> ``emb_dim``, ``n_layer`` -> ``n_layers``,
``n_head`` -> ``n_heads``, ``vocab_size``, ``layer_norm_epsilon`` -> ``layer_norm_eps``,
``tie_word_embeddings`` -> ``tie_embeddings``, ``resid_pdrop`` -> ``drop_rate`` (our one dropout rate; ``embd_pdrop``
and ``attn_pdrop`` are not read); ``qkv_bias`` is true when the file holds ``c_attn.bias``. Checked and refused when our
model cannot compute the same function: ``model_type`` other than gpt2, ``activation_function`` other than
``gelu_new``/``gelu_pytorch_tanh`` (both are the tanh GELU our ``GELU`` computes), ``n_inner`` other than 4E,
``scale_attn_weights`` false, ``scale_attn_by_inverse_layer_idx`` true, ``add_cross_attention`` true.

Our tokenizer renames a few ``[unused*]`` slots of the bert-base-chinese vocabulary (newline, space, curly quotes ...);
ids are unchanged, so uer's weights work as they are. uer's config.json gives bos/eos 50256 (English GPT-2's
``<|endoftext|>``, outside a 21128-id vocabulary); those fields are not read, and an export writes [CLS]/[SEP]. Weights
stored in float16/bfloat16 are widened to float32, the precision this project keeps its weights in.

The command ``load_weight.py`` converts a directory either way with these functions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from chinese_tokenizer import CLS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, TokenizerError, load_tokenizer
from gpt_model import GPTConfig, GPTModel
from plumbing.checkpoint import load_pickle_free, replace_dir
from plumbing.cli import UserError, default_path

CONFIG_FILE = "config.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_FILE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

# The defaults of transformers.GPT2Config, used for fields a config.json leaves out (as transformers does).
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
               "activation_function": "gelu_new", "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
               "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
               "add_cross_attention": False}
# Both names denote 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), the GELU of gpt_model.GELU.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# Per-block tensors other than c_attn: (HF name, our name, stored as Conv1D (in, out) so transposed).
BLOCK_MAP = [
    ("ln_1.weight", "norm1.scale", False),
    ("ln_1.bias", "norm1.shift", False),
    ("attn.c_proj.weight", "att.out_proj.weight", True),
    ("attn.c_proj.bias", "att.out_proj.bias", False),
    ("ln_2.weight", "norm2.scale", False),
    ("ln_2.bias", "norm2.shift", False),
    ("mlp.c_fc.weight", "ff.layers.0.weight", True),
    ("mlp.c_fc.bias", "ff.layers.0.bias", False),
    ("mlp.c_proj.weight", "ff.layers.2.weight", True),
    ("mlp.c_proj.bias", "ff.layers.2.bias", False),
]
TOP_MAP = [("wte.weight", "tok_emb.weight"), ("wpe.weight", "pos_emb.weight"),
           ("ln_f.weight", "final_norm.scale"), ("ln_f.bias", "final_norm.shift")]
# The causal-mask buffers older transformers versions saved with the weights.
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
DOWNLOAD_HINT = ("on a machine with network: hf download uer/gpt2-chinese-cluecorpussmall "
                 "--local-dir DIR, then copy DIR here")


def read_hf_config(path: str) -> dict:
    """The ``config.json`` of HF directory ``path`` with ``transformers.GPT2Config``'s defaults filled in.

    Raises:
        UserError: ``path`` is not a directory, has no readable ``config.json``, or is not a GPT-2 config.
    """
    if not os.path.isdir(path):
        raise UserError(f"{path} is not a local directory; download a GPT-2 there first ({DOWNLOAD_HINT})")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise UserError(f"no {CONFIG_FILE} in {path}; point to a Hugging Face GPT-2 directory ({DOWNLOAD_HINT})")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{config_path} is not valid JSON ({e}); download the model again") from e
    if not isinstance(config, dict):
        raise UserError(f"{config_path} does not hold a JSON object; download the model again")
    if "stage" in config and "model" in config:
        raise UserError(f"{path} is a checkpoint of this project, not a Hugging Face directory; "
                        f"give it to a stage as --init {path} (e.g. 1-SFT.py), or to generate.py as --checkpoint")
    if config.get("model_type", "gpt2") != "gpt2":
        raise UserError(f"{config_path} describes a '{config['model_type']}' model; only GPT-2 (model_type gpt2) "
                        f"maps onto GPTModel")
    return {**HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in HF_DEFAULTS}}


def gpt_config_from_hf(hf: dict, qkv_bias: bool, where: str) -> GPTConfig:
    """Translate a GPT-2 ``config.json`` (defaults filled in) into our ``GPTConfig``.

    Raises:
        UserError: a setting our model cannot reproduce (activation, MLP width, attention scaling, cross-attention)
            or sizes ``GPTConfig`` rejects; the message names ``where``.
    """
    if hf["activation_function"] not in TANH_GELUS:
        raise UserError(f"{where}: activation_function is {hf['activation_function']!r}, but GPTModel computes the "
                        f"tanh GELU ({' or '.join(TANH_GELUS)}); this model cannot be loaded without changing its "
                        f"activation")
    n_inner = hf["n_inner"]
    if n_inner is not None and n_inner != 4 * hf["n_embd"]:
        raise UserError(f"{where}: n_inner is {n_inner}, but GPTModel's feed-forward is 4 * n_embd = "
                        f"{4 * hf['n_embd']} wide; this model cannot be loaded")
    if not hf["scale_attn_weights"] or hf["scale_attn_by_inverse_layer_idx"] or hf["add_cross_attention"]:
        raise UserError(f"{where}: scale_attn_weights must be true and scale_attn_by_inverse_layer_idx and "
                        f"add_cross_attention false (plain GPT-2 attention); this variant cannot be loaded")
    try:
        # GPT-2s on the BERT-Chinese vocabulary (uer's) were trained on "[CLS] text [SEP]": their prompts and
        # documents start with [CLS]; OpenAI's join documents with <|endoftext|>, a token our tokenizer lacks
        return GPTConfig(vocab_size=hf["vocab_size"], context_length=hf["n_positions"], emb_dim=hf["n_embd"],
                         n_heads=hf["n_head"], n_layers=hf["n_layer"], drop_rate=float(hf["resid_pdrop"]),
                         qkv_bias=qkv_bias, tie_embeddings=bool(hf["tie_word_embeddings"]),
                         layer_norm_eps=float(hf["layer_norm_epsilon"]),
                         bos_id=CLS_ID if hf["vocab_size"] == VOCAB_SIZE else None)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}; the config does not describe a usable GPT-2") from e


def hf_weight_files(path: str) -> list[str]:
    """The weight files of HF directory ``path``: safetensors if present, else the pickle ``.bin``; one file or the
    shards an ``*.index.json`` lists.

    Raises:
        UserError: no weight file, or an unreadable index.
    """
    for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (PICKLE_FILE, PICKLE_INDEX)):
        if os.path.isfile(os.path.join(path, single)):
            return [os.path.join(path, single)]
        index_path = os.path.join(path, index)
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise UserError(f"{index_path} is not a valid weight index ({e}); download the model again") from e
            return [os.path.join(path, shard) for shard in shards]
    raise UserError(f"no {SAFETENSORS_FILE} or {PICKLE_FILE} in {path}; download the PyTorch weights too "
                    f"(TensorFlow/Flax-only directories are not supported)")


def read_hf_state_dict(path: str) -> dict:
    """All tensors of HF directory ``path`` as {name: float32 tensor}, names without the ``transformer.`` prefix.

    ``.bin`` files are read with ``torch.load(weights_only=True)`` (``checkpoint.load_pickle_free``): a pickle that
    would construct anything but tensors is refused, so loading can never run code.

    Raises:
        UserError: a missing, damaged or unsafe file, or a name that appears twice.
    """
    state = {}
    for file in hf_weight_files(path):
        if not os.path.isfile(file):
            raise UserError(f"weight shard {file} is missing; download the model again")
        if file.endswith(".safetensors"):
            try:
                tensors = load_file(file)
            except (SafetensorError, OSError) as e:
                raise UserError(f"{file} is not a readable safetensors file ({e}); download it again") from e
        else:
            tensors = load_pickle_free(file)
            if isinstance(tensors, dict) and "state_dict" in tensors and isinstance(tensors["state_dict"], dict):
                tensors = tensors["state_dict"]
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise UserError(f"{file} does not hold a dict of tensors; it is not a GPT-2 state dict")
        for name, tensor in tensors.items():
            name = name.removeprefix("transformer.")
            if name in state:
                raise UserError(f"{file}: weight {name} appears twice (with and without the 'transformer.' prefix)")
            state[name] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def _hf_names(cfg: GPTConfig) -> set[str]:
    """The HF tensor names a GPT-2 of config ``cfg`` must have (buffers and a tied ``lm_head`` excluded)."""
    names = {hf for hf, _ in TOP_MAP}
    for i in range(cfg.n_layers):
        names |= {f"h.{i}.{hf}" for hf, _, _ in BLOCK_MAP} | {f"h.{i}.attn.c_attn.weight"}
        if cfg.qkv_bias:
            names.add(f"h.{i}.attn.c_attn.bias")
    if not cfg.tie_embeddings:
        names.add("lm_head.weight")
    return names


def _listing(names) -> str:
    names = sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def hf_to_gpt_state_dict(hf_state: dict, cfg: GPTConfig) -> dict:
    """Map an HF GPT-2 state dict (names without ``transformer.``) onto ``GPTModel(cfg)``'s parameter names."""
    ours = {}
    for hf, name in TOP_MAP:
        ours[name] = hf_state[hf]
    e = cfg.emb_dim
    for i in range(cfg.n_layers):
        prefix, att = f"h.{i}.", f"trf_blocks.{i}.att."
        w_qkv = hf_state[prefix + "attn.c_attn.weight"]  # (E, 3E): x @ w_qkv = [q | k | v]
        for j, proj in enumerate(("W_query", "W_key", "W_value")):
            ours[att + proj + ".weight"] = w_qkv[:, j * e:(j + 1) * e].t().contiguous()  # (E, E), (out, in)
            if cfg.qkv_bias:
                ours[att + proj + ".bias"] = hf_state[prefix + "attn.c_attn.bias"][j * e:(j + 1) * e]  # (E,)
        for hf, name, conv1d in BLOCK_MAP:
            tensor = hf_state[prefix + hf]
            ours[f"trf_blocks.{i}.{name}"] = tensor.t().contiguous() if conv1d else tensor
    ours["out_head.weight"] = ours["tok_emb.weight"] if cfg.tie_embeddings else hf_state["lm_head.weight"]
    return ours


def load_hf_gpt2(path: str) -> GPTModel:
    """Load a local Hugging Face GPT-2 directory into a ``GPTModel`` (eval mode, CPU, float32).

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin`` (or their
            sharded ``*.index.json`` forms), e.g. a ``hf download ... --local-dir`` of
            uer/gpt2-chinese-cluecorpussmall or gpt2.
    Returns:
        A ``GPTModel`` whose logits equal ``transformers.GPT2LMHeadModel.from_pretrained(path)``'s.
    Raises:
        UserError: not a GPT-2 directory, a config our model cannot reproduce, unsafe or damaged weight files,
            weights missing or left over (listed by name), or shapes that disagree with ``config.json``.
    """
    hf_config = read_hf_config(path)
    hf_state = read_hf_state_dict(path)
    qkv_bias = "h.0.attn.c_attn.bias" in hf_state
    cfg = gpt_config_from_hf(hf_config, qkv_bias, os.path.join(path, CONFIG_FILE))

    expected = _hf_names(cfg)
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = expected - set(hf_state)
    unknown = set(hf_state) - expected - optional - {n for n in hf_state if MASK_BUFFER.fullmatch(n)}
    if missing or unknown:
        problems = ([f"missing {len(missing)} weights ({_listing(missing)})"] if missing else []) + \
                   ([f"{len(unknown)} unknown weights ({_listing(unknown)})"] if unknown else [])
        raise UserError(f"{path}: the weights do not match a GPT-2 with {cfg.n_layers} layers as config.json says: "
                        f"{'; '.join(problems)}; download the model again or fix config.json")

    model = GPTModel(cfg)
    ours = hf_to_gpt_state_dict(hf_state, cfg)
    for name, param in model.state_dict().items():
        if ours[name].shape != param.shape:
            raise UserError(f"{path}: {name} has shape {tuple(ours[name].shape)} in the weight file but config.json "
                            f"implies {tuple(param.shape)}; the config and the weights belong to different models")
    model.load_state_dict(ours, strict=True)
    return model.eval()


def special_token_ids(vocab_size: int) -> dict:
    """bos/eos/pad ids for an exported config: [CLS]/[SEP]/[PAD] for our 21128-id vocabulary; GPT-2's
    ``<|endoftext|>`` (50256) for OpenAI's 50257-id BPE; none for any other vocabulary."""
    if vocab_size == VOCAB_SIZE:
        return {"bos_token_id": CLS_ID, "eos_token_id": SEP_ID, "pad_token_id": PAD_ID}
    if vocab_size == 50257:
        return {"bos_token_id": 50256, "eos_token_id": 50256}
    return {}


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """The ``config.json`` of ``transformers.GPT2LMHeadModel`` for a ``GPTModel(cfg)``."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.context_length, "n_embd": cfg.emb_dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": cfg.drop_rate,
            "embd_pdrop": cfg.drop_rate, "attn_pdrop": cfg.drop_rate, "layer_norm_epsilon": cfg.layer_norm_eps,
            "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": cfg.tie_embeddings,
            "use_cache": True, "torch_dtype": "float32", **special_token_ids(cfg.vocab_size)}


def gpt_to_hf_state_dict(model: GPTModel) -> dict:
    """``model``'s weights under HF GPT-2 names (``transformer.`` prefix), projections back in Conv1D (in, out)
    layout, q/k/v fused into ``c_attn``. Without ``qkv_bias`` the ``c_attn`` bias is written as zeros (HF's GPT-2
    always has one). ``lm_head.weight`` is written only when the head is not tied."""
    cfg, ours = model.cfg, {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    hf = {f"transformer.{name}": ours[our] for name, our in TOP_MAP}
    for i in range(cfg.n_layers):
        prefix, att = f"transformer.h.{i}.", f"trf_blocks.{i}.att."
        projs = ("W_query", "W_key", "W_value")
        hf[prefix + "attn.c_attn.weight"] = torch.cat([ours[att + p + ".weight"].t() for p in projs], dim=1)  # (E, 3E)
        hf[prefix + "attn.c_attn.bias"] = (torch.cat([ours[att + p + ".bias"] for p in projs]) if cfg.qkv_bias
                                           else torch.zeros(3 * cfg.emb_dim))  # (3E,)
        for name, our, conv1d in BLOCK_MAP:
            tensor = ours[f"trf_blocks.{i}.{our}"]
            hf[prefix + name] = tensor.t() if conv1d else tensor
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = ours["out_head.weight"]
    return {k: v.contiguous().clone() for k, v in hf.items()}  # own storage each: safetensors refuses shared memory


def save_hf_gpt2(model: GPTModel, out_dir: str, tokenizer=None, overwrite: bool = False) -> None:
    """Write ``model`` as a Hugging Face GPT-2 directory: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` and, when given, the tokenizer (``save_pretrained``; ``AutoTokenizer`` then encodes as
    ours does, but its decode puts a space between characters: decode with ``chinese_tokenizer`` to avoid that).

    ``GPT2LMHeadModel.from_pretrained(out_dir)`` then gives the same logits as ``model``. For our vocabulary the
    config says bos = [CLS] (101), eos = [SEP] (102), pad = [PAD] (0). The directory is built beside ``out_dir`` and
    renamed into place, so an interrupted export leaves no half-written directory.

    Raises:
        UserError: the model uses RMSNorm or rotary positions (GPT-2's format has neither), ``out_dir`` exists and
            ``overwrite`` is false, or the disk write fails.
    """
    cfg = model.cfg
    if cfg.norm != "layernorm" or cfg.position_embedding != "learned":
        options = [f"{k}={v!r}" for k, v, gpt2 in (("norm", cfg.norm, "layernorm"),
                                                   ("position_embedding", cfg.position_embedding, "learned"))
                   if v != gpt2]
        raise UserError(f"cannot export to GPT-2 format: the model uses {' and '.join(options)}, which GPT-2 does not "
                        f"have (the demo preset uses rotary positions); export a model trained with LayerNorm and "
                        f"learned positions, e.g. --preset gpt2-zh-small or uer-gpt2-chinese")
    if os.path.exists(out_dir) and not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite (overwrite=True) to replace it, or choose "
                        f"another directory")
    if os.path.isfile(out_dir):
        raise UserError(f"{out_dir} is a file; choose a directory path")
    config = hf_config_from_gpt(cfg)
    generation = {k: v for k, v in config.items() if k.endswith("_token_id")}
    tmp = None
    try:
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        save_file(gpt_to_hf_state_dict(model), os.path.join(tmp, SAFETENSORS_FILE), metadata={"format": "pt"})
        for name, content in ((CONFIG_FILE, config), ("generation_config.json", generation)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out_dir)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write {out_dir}: {e.strerror or e}; free some disk space or choose another "
                        f"directory") from e


def import_tokenizer(hf_dir: str, explicit: str | None):
    """The tokenizer for an imported model: ``explicit`` if given, else the HF directory's own when it is ours
    (uer ships the bert-base-chinese ``vocab.txt``), else ``data/tokenizer``.

    Raises:
        UserError: ``explicit`` is unusable, or neither fallback is.
    """
    if explicit:
        try:
            return load_tokenizer(explicit)
        except TokenizerError as e:
            raise UserError(f"--tokenizer: {e}") from e
    for candidate in (hf_dir, default_path("data", "tokenizer")):
        try:
            return load_tokenizer(candidate)
        except TokenizerError:
            continue
    raise UserError(f"no usable tokenizer: {hf_dir} has no bert-base-chinese vocab.txt and data/tokenizer is missing;"
                    f" run `python data/prepare.py --tokenizer-only` or pass --tokenizer DIR")
