"""Weights in and out of ``transformers``: Hugging Face directories <-> our ``GPTModel`` and ``RewardModel``.

Every configuration ``gpt_model.py`` can build leaves as the ``transformers`` architecture that computes the same
function, or is refused in one line (``architecture_for``):

=============  ====================  =========================================================================
norm           position_embedding    ``transformers`` architecture (``model_type``)
=============  ====================  =========================================================================
layernorm      learned               GPT-2 (``gpt2``): the original; uer's and OpenAI's weights come in this way
layernorm      rope (the demo)       GPT-NeoX (``gpt_neox``) with ``use_parallel_residual=False`` (sequential
                                     residuals, as ours), ``rotary_pct=1.0`` (every dimension rotates),
                                     ``attention_bias=True``, ``hidden_act="gelu_pytorch_tanh"``
rmsnorm        rope                  Arcee (``arcee``): Llama's RMSNorm, attention and rotary embeddings with a
                                     plain (not gated) MLP; ``attention_bias``/``mlp_bias`` true, tanh GELU
rmsnorm        learned               refused: no ``transformers`` decoder has RMSNorm and a learned position table
=============  ====================  =========================================================================

A language model becomes ``*ForCausalLM`` (``GPT2LMHeadModel``); a reward model becomes
``*ForSequenceClassification`` with ``num_labels=1``, which, as ours, reads its score at each row's last token that
is not ``pad_token_id``. Loading goes the other way for the same architectures (``load_hf_model``).

What differs in storage, so what is moved on the way (each map below, our name first):

* GPT-2 keeps projections as ``Conv1D`` (``y = x @ W + b``, W (in, out)); our ``nn.Linear`` holds W (out, in), so
  GPT-2's matrices are transposed. GPT-NeoX and Arcee use ``nn.Linear`` too: no transpose.
* q/k/v: GPT-2 fuses them into ``c_attn`` (E, 3E) as [q | k | v]; GPT-NeoX into ``query_key_value`` (3E, E) head
  by head, [q_h; k_h; v_h] for h = 0..H-1; Arcee keeps three. Without ``qkv_bias`` their biases are written as
  zeros (the formats have them), and an import whose q/k/v biases are all zero drops them again.
* Rotary pairing: ours rotates adjacent dimensions (2i, 2i+1) of a head (``gpt_model.apply_rope``), GPT-NeoX and
  Arcee rotate halves (i, i + d_h/2) (``rotate_half``), each pair at the same frequency base^(-2i/d_h). So the
  output rows of the query and key projections are permuted within each head, our row 2i to row i and 2i+1 to
  i + d_h/2 (``ROPE_TO_HALVES``), and back on import. Queries and keys move alike, so every q.k and the output
  are unchanged; values and everything else keep their order.
* The reward head ``Linear(E, 1)`` has a bias; ``score`` in ``transformers`` has none. For LayerNorm models the bias
  b is folded into the final norm's shift at the coordinate j with the largest |w_j| (shift_j += b / w_j, so
  w . shift grows by b); ``config.json`` records b, j and the old shift_j under ``"score_bias_fold"`` so an import
  restores them bit for bit. An RMSNorm reward model has no shift: its export is refused unless b == 0.
* Tied embeddings (``tie_word_embeddings``) store one matrix; an untied head is ``lm_head.weight`` (GPT-2,
  Arcee) or ``embed_out.weight`` (GPT-NeoX, the name its checkpoints use; ``transformers`` 5 renames it on load).

Name maps (i = block index; shapes ours). GPT-2 (``transformer.`` prefix, Conv1D transposed)::

    tok_emb.weight (V, E)            wte.weight
    pos_emb.weight (T, E)            wpe.weight
    trf_blocks.i.norm1.scale/shift   h.i.ln_1.weight/bias
    ...att.W_query/W_key/W_value     h.i.attn.c_attn.weight (E, 3E) / .bias (3E,), fused as [q | k | v]
    ...att.out_proj                  h.i.attn.c_proj
    trf_blocks.i.norm2.scale/shift   h.i.ln_2.weight/bias
    ...ff.layers.0 / ff.layers.2     h.i.mlp.c_fc / h.i.mlp.c_proj
    final_norm.scale/shift           ln_f.weight/bias

GPT-NeoX (``gpt_neox.`` prefix): ``embed_in``, ``layers.i.input_layernorm``,
``layers.i.attention.query_key_value`` (3E, E) fused per head with q and k rows permuted,
``layers.i.attention.dense``, ``layers.i.post_attention_layernorm``, ``layers.i.mlp.dense_h_to_4h`` /
``dense_4h_to_h``, ``final_layer_norm``.

Arcee (``model.`` prefix): ``embed_tokens``, ``layers.i.input_layernorm.weight``,
``layers.i.self_attn.q_proj`` / ``k_proj`` (rows permuted) / ``v_proj`` / ``o_proj``,
``layers.i.post_attention_layernorm.weight``, ``layers.i.mlp.up_proj`` / ``down_proj``, ``norm.weight``.

GPT-2 keys appear as ``transformer.h.0...`` (``GPT2LMHeadModel``, e.g. uer) or bare ``h.0...`` (``GPT2Model``, e.g.
OpenAI's gpt2 ``model.safetensors``); both load. ``attn.bias``/``attn.masked_bias`` in older files are causal-mask
buffers, not weights: skipped. A copy of a tied head is ignored, as ``transformers`` does.

Config: each architecture's fields map onto ``GPTConfig`` (``context_length``, ``emb_dim``, ``n_layers``,
``n_heads``, ``vocab_size``, the norm's epsilon, ``tie_embeddings``, the dropout rate); anything our model cannot
compute is refused naming the field (another activation, MLP width, parallel residuals, partial or scaled rotary,
another rotary base than 10000, attention-scaling variants, cross-attention, grouped keys/values). Our exports
add ``"prompt_starts_with_bos"``: whether prompts start with ``bos_token_id`` (``GPTConfig.bos_id``, true for uer's
"[CLS] text [SEP]" documents, false for ours); a directory without it counts as true for our 21128-id vocabulary
(uer) and false otherwise. uer's config.json gives bos/eos 50256 (English GPT-2's ``<|endoftext|>``, outside a
21128-id vocabulary): not read; exports write [CLS]/[SEP]/[PAD]. Weights in float16/bfloat16 are widened to float32.

LoRA adapters (``save_peft_adapter``) leave as a ``peft`` adapter to load over the base model's export:
``adapter_config.json`` and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` (r, in) and
``.lora_B.weight`` (out, r), the shapes ours in every architecture, GPT-2's Conv1D included (its
``fan_in_fan_out`` only makes ``peft`` transpose the merged delta). A target goes to the module its weight goes to
(``PEFT_MODULES``), and B's rows move as the weight's rows do: q/k rows permuted for rotary. A fused module (GPT-2
``c_attn``, GPT-NeoX ``query_key_value``) gets one LoRA for the n parts of q, k, v that have adapters, in that order::

    A_fused = [A_q; A_k; A_v]  (n r, E)   the adapted parts' A stacked
    B_fused                    (3E, n r)  part p's rows hold B_p in p's r columns, zeros elsewhere
    B_fused @ A_fused          (3E, E)    part p's rows get B_p @ A_p: each delta lands on its weight's rows

Part p's rows are its weight's rows in the base export: [q; k; v] for GPT-2 (``c_attn``'s columns), head by head
[q_h; k_h; v_h] for GPT-NeoX. ``peft`` scales each module by its own alpha / rank; the fused one has rank n r, so
``rank_pattern`` gives it n r and ``alpha_pattern`` n alpha: n alpha / (n r) = alpha / r, our scaling. A reward
model's adapters are refused: merge them and export the merged model.

The command ``load_weight.py`` converts a directory either way with these functions; ``0-PRETRAIN.py
--init_from_hf`` and ``generate.py --from_hf`` load language models with ``load_hf_model``.
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

from chinese_tokenizer import CLS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, TokenizerError, export_tokenizer, load_tokenizer
from gpt_model import GPTConfig, GPTModel, RewardModel
from plumbing.checkpoint import load_pickle_free, replace_dir
from plumbing.cli import UserError, default_path

CONFIG_FILE = "config.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_FILE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

# (norm, position_embedding) -> the transformers model_type that computes the same function
ARCHITECTURES = {("layernorm", "learned"): "gpt2", ("layernorm", "rope"): "gpt_neox", ("rmsnorm", "rope"): "arcee"}
NO_EQUIVALENT = {("rmsnorm", "learned"): "no transformers decoder pairs RMSNorm with a learned position table (the "
                                         "ones with such a table, GPT-2, GPT-Neo, OPT and GPT-BigCode, all use "
                                         "LayerNorm); build the model with GPTConfig(norm='layernorm') or "
                                         "position_embedding='rope' to export it"}
# model_type -> (causal LM class, sequence-classification class, prefix of the base model's names in a file)
CLASSES = {"gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification", "transformer."),
           "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXForSequenceClassification", "gpt_neox."),
           "arcee": ("ArceeForCausalLM", "ArceeForSequenceClassification", "model.")}
# the name of an untied output head in each architecture's files
UNTIED_HEAD = {"gpt2": "lm_head.weight", "gpt_neox": "embed_out.weight", "arcee": "lm_head.weight"}
SCORE = "score.weight"  # (1, E) the reward head of every *ForSequenceClassification
# what an exported tokenizer returns: no token_type_ids, which the models do not take (generate(**batch) refuses them)
MODEL_INPUTS = ("input_ids", "attention_mask")
ROPE_BASE = 10000.0  # gpt_model.rope_angles' base

# Defaults of the transformers configs for the fields read here (a config.json may leave them out).
HF_DEFAULTS = {
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "activation_function": "gelu_new", "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
             "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "add_cross_attention": False},
    "gpt_neox": {"hidden_act": "gelu", "hidden_dropout": 0.0, "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
                 "use_parallel_residual": True, "attention_bias": True, "rotary_pct": 0.25,
                 "rotary_emb_base": ROPE_BASE},
    "arcee": {"hidden_act": "relu2", "attention_dropout": 0.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "num_key_value_heads": None, "head_dim": None,
              "rope_theta": ROPE_BASE},
}
# Both names denote 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), the GELU of gpt_model.GELU.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")

# Per-block tensors other than q/k/v: (our name, HF name, transposed). GPT-2's Conv1D holds (in, out).
BLOCK_MAPS = {
    "gpt2": [("norm1.scale", "ln_1.weight", False), ("norm1.shift", "ln_1.bias", False),
             ("att.out_proj.weight", "attn.c_proj.weight", True), ("att.out_proj.bias", "attn.c_proj.bias", False),
             ("norm2.scale", "ln_2.weight", False), ("norm2.shift", "ln_2.bias", False),
             ("ff.layers.0.weight", "mlp.c_fc.weight", True), ("ff.layers.0.bias", "mlp.c_fc.bias", False),
             ("ff.layers.2.weight", "mlp.c_proj.weight", True), ("ff.layers.2.bias", "mlp.c_proj.bias", False)],
    "gpt_neox": [("norm1.scale", "input_layernorm.weight", False), ("norm1.shift", "input_layernorm.bias", False),
                 ("att.out_proj.weight", "attention.dense.weight", False),
                 ("att.out_proj.bias", "attention.dense.bias", False),
                 ("norm2.scale", "post_attention_layernorm.weight", False),
                 ("norm2.shift", "post_attention_layernorm.bias", False),
                 ("ff.layers.0.weight", "mlp.dense_h_to_4h.weight", False),
                 ("ff.layers.0.bias", "mlp.dense_h_to_4h.bias", False),
                 ("ff.layers.2.weight", "mlp.dense_4h_to_h.weight", False),
                 ("ff.layers.2.bias", "mlp.dense_4h_to_h.bias", False)],
    "arcee": [("norm1.scale", "input_layernorm.weight", False),
              ("att.out_proj.weight", "self_attn.o_proj.weight", False),
              ("att.out_proj.bias", "self_attn.o_proj.bias", False),
              ("norm2.scale", "post_attention_layernorm.weight", False),
              ("ff.layers.0.weight", "mlp.up_proj.weight", False), ("ff.layers.0.bias", "mlp.up_proj.bias", False),
              ("ff.layers.2.weight", "mlp.down_proj.weight", False),
              ("ff.layers.2.bias", "mlp.down_proj.bias", False)],
}
# Tensors outside the blocks: (our name, HF name).
TOP_MAPS = {
    "gpt2": [("tok_emb.weight", "wte.weight"), ("pos_emb.weight", "wpe.weight"),
             ("final_norm.scale", "ln_f.weight"), ("final_norm.shift", "ln_f.bias")],
    "gpt_neox": [("tok_emb.weight", "embed_in.weight"), ("final_norm.scale", "final_layer_norm.weight"),
                 ("final_norm.shift", "final_layer_norm.bias")],
    "arcee": [("tok_emb.weight", "embed_tokens.weight"), ("final_norm.scale", "norm.weight")],
}
LAYER_PREFIX = {"gpt2": "h.", "gpt_neox": "layers.", "arcee": "layers."}
QKV = ("W_query", "W_key", "W_value")
# The causal-mask buffers older transformers versions saved with the weights.
MASK_BUFFER = re.compile(r"(h|layers)\.\d+\.(attn|attention)\.(bias|masked_bias)")
DOWNLOAD_HINT = ("on a machine with network: hf download uer/gpt2-chinese-cluecorpussmall "
                 "--local-dir DIR, then copy DIR here")


def architecture_for(cfg: GPTConfig) -> str:
    """The ``transformers`` model_type that computes ``GPTModel(cfg)``'s function (module docstring's table).

    Raises:
        UserError: the combination has no equivalent (RMSNorm with learned positions), saying why.
    """
    key = (cfg.norm, cfg.position_embedding)
    if key in NO_EQUIVALENT:
        raise UserError(f"cannot export norm={cfg.norm!r} with position_embedding={cfg.position_embedding!r}: "
                        f"{NO_EQUIVALENT[key]}")
    return ARCHITECTURES[key]


def rope_to_halves(head_dim: int) -> torch.Tensor:
    """(d_h,) the row order that turns our adjacent rotary pairs into ``rotate_half``'s halves: new row k is old
    row ``order[k]``, i.e. [0, 2, 4, ..., d_h-2, 1, 3, ..., d_h-1]. ``torch.argsort(order)`` undoes it."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_heads(tensor, n_heads: int, order) -> torch.Tensor:
    """Reorder the output rows of a query or key projection within each head: (E, ...) -> (E, ...), rows taken as
    (n_heads, d_h) and row k of each head taken from its row ``order[k]``. Works on a weight (E, E) or a bias (E,)."""
    return tensor.unflatten(0, (n_heads, -1))[:, order].flatten(0, 1)


def read_hf_config(path: str) -> dict:
    """The ``config.json`` of HF directory ``path`` with its architecture's defaults filled in (``HF_DEFAULTS``);
    ``model_type`` is always set (a GPT-2 file may leave it out).

    Raises:
        UserError: ``path`` is not a directory, has no readable ``config.json``, is one of our checkpoints, or
            names an architecture that does not map onto ``GPTModel``.
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
    model_type = config.get("model_type", "gpt2")
    if model_type not in HF_DEFAULTS:
        raise UserError(f"{config_path} describes a '{model_type}' model; only {', '.join(HF_DEFAULTS)} (the "
                        f"architectures our exports use) map onto GPTModel")
    defaults = HF_DEFAULTS[model_type]
    return {**defaults, **{k: v for k, v in config.items() if v is not None or k not in defaults},
            "model_type": model_type}


def _rope_settings(hf: dict, where: str) -> None:
    """Refuse rotary settings ``apply_rope`` does not compute: a rope_type other than the default (no scaling),
    another base than 10000, or rotating only part of each head."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    legacy_base = hf.get("rotary_emb_base", hf.get("rope_theta", ROPE_BASE))
    base = rope.get("rope_theta", legacy_base)
    fraction = rope.get("partial_rotary_factor", hf.get("rotary_pct", 1.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" or float(base) != ROPE_BASE or float(fraction) != 1.0:
        raise UserError(f"{where}: rotary embeddings of type {kind!r}, base {base}, on a fraction {fraction} of each "
                        f"head; GPTModel rotates every dimension with base {ROPE_BASE:g} and no scaling, so this "
                        f"model cannot be loaded")


def gpt_config_from_hf(hf: dict, qkv_bias: bool, where: str) -> GPTConfig:
    """Translate a ``config.json`` (``read_hf_config``'s, defaults filled in) into our ``GPTConfig``.

    Raises:
        UserError: a setting our model cannot reproduce (activation, MLP width, attention scaling, cross-attention,
            parallel residuals, grouped keys/values, rotary variants, missing biases) or sizes ``GPTConfig``
            rejects; the message names ``where`` and the field.
    """
    arch = hf["model_type"]
    if arch == "gpt2":
        sizes = {"context_length": hf["n_positions"], "emb_dim": hf["n_embd"], "n_heads": hf["n_head"],
                 "n_layers": hf["n_layer"]}
        act_field, inner_field = "activation_function", "n_inner"
        eps, drop = hf["layer_norm_epsilon"], hf["resid_pdrop"]
        if not hf["scale_attn_weights"] or hf["scale_attn_by_inverse_layer_idx"] or hf["add_cross_attention"]:
            raise UserError(f"{where}: scale_attn_weights must be true and scale_attn_by_inverse_layer_idx and "
                            f"add_cross_attention false (plain GPT-2 attention); this variant cannot be loaded")
    else:
        absent = [k for k in ("vocab_size", "max_position_embeddings", "hidden_size", "num_attention_heads",
                              "num_hidden_layers", "intermediate_size") if k not in hf]
        if absent:
            raise UserError(f"{where} has no {', '.join(absent)}; it does not describe a whole {arch} model")
        sizes = {"context_length": hf["max_position_embeddings"], "emb_dim": hf["hidden_size"],
                 "n_heads": hf["num_attention_heads"], "n_layers": hf["num_hidden_layers"]}
        act_field, inner_field = "hidden_act", "intermediate_size"
        if arch == "gpt_neox":
            eps, drop = hf["layer_norm_eps"], hf["hidden_dropout"]
            if hf["use_parallel_residual"]:
                raise UserError(f"{where}: use_parallel_residual is true (attention and MLP read the same input), "
                                f"but GPTModel's blocks are sequential; this model cannot be loaded")
            biased = hf["attention_bias"]
        else:
            eps, drop = hf["rms_norm_eps"], hf["attention_dropout"]
            heads = sizes["n_heads"]
            if hf["num_key_value_heads"] not in (None, heads) or \
                    hf["head_dim"] not in (None, sizes["emb_dim"] // max(heads, 1)):
                raise UserError(f"{where}: num_key_value_heads {hf['num_key_value_heads']} / head_dim "
                                f"{hf['head_dim']}: grouped keys/values or another head size than hidden_size / "
                                f"heads, which GPTModel does not have; this model cannot be loaded")
            biased = hf["attention_bias"] and hf["mlp_bias"]
        if not biased:
            raise UserError(f"{where}: attention_bias{'' if arch == 'gpt_neox' else '/mlp_bias'} false, but "
                            f"GPTModel's output projection and feed-forward always have biases; this model cannot "
                            f"be loaded")
        _rope_settings(hf, where)
    act, inner = hf[act_field], hf[inner_field]
    if act not in TANH_GELUS:
        raise UserError(f"{where}: {act_field} is {act!r}, but GPTModel computes the tanh GELU "
                        f"({' or '.join(TANH_GELUS)}); this model cannot be loaded without changing its activation")
    if inner is not None and inner != 4 * sizes["emb_dim"]:
        raise UserError(f"{where}: {inner_field} is {inner}, but GPTModel's feed-forward is 4 * hidden size = "
                        f"{4 * sizes['emb_dim']}; this model cannot be loaded")
    vocab_size = hf.get("vocab_size")
    # uer's GPT-2 on our vocabulary was trained on "[CLS] text [SEP]", so its prompts start with [CLS]; OpenAI's
    # join documents with <|endoftext|>, a token our tokenizer lacks; our own exports say which
    starts_with_bos = hf.get("prompt_starts_with_bos", vocab_size == VOCAB_SIZE)
    bos = hf.get("bos_token_id")
    bos_id = None
    if starts_with_bos:
        bos_id = CLS_ID if vocab_size == VOCAB_SIZE else bos if isinstance(bos, int) else None
    try:
        return GPTConfig(vocab_size=vocab_size, drop_rate=float(drop), qkv_bias=qkv_bias,
                         tie_embeddings=bool(hf["tie_word_embeddings"]), layer_norm_eps=float(eps),
                         norm="rmsnorm" if arch == "arcee" else "layernorm",
                         position_embedding="learned" if arch == "gpt2" else "rope", bos_id=bos_id, **sizes)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}; the config does not describe a usable model") from e


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


def read_hf_state_dict(path: str, prefix: str = "transformer.") -> dict:
    """All tensors of HF directory ``path`` as {name: float32 tensor}, names without the base model's ``prefix``
    (``transformer.``, ``gpt_neox.`` or ``model.``: ``CLASSES``).

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
                raise UserError(f"{file} does not hold a dict of tensors; it is not a model's state dict")
        for name, tensor in tensors.items():
            name = name.removeprefix(prefix)
            if name in state:
                raise UserError(f"{file}: weight {name} appears twice (with and without the {prefix!r} prefix)")
            state[name] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def _qkv_names(arch: str, block: str) -> list[str]:
    """The HF names of one block's query/key/value weights and biases (fused or not)."""
    fused = {"gpt2": "attn.c_attn", "gpt_neox": "attention.query_key_value"}.get(arch)
    if fused:
        return [f"{block}{fused}.weight", f"{block}{fused}.bias"]
    return [f"{block}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")]


def _hf_names(cfg: GPTConfig, arch: str, reward: bool) -> set[str]:
    """The tensor names (base prefix stripped) a model of ``cfg`` must have in ``arch``'s files: what
    ``gpt_to_hf_state_dict`` writes; buffers and a tied head's copy excluded."""
    names = {theirs for _, theirs in TOP_MAPS[arch]}
    for i in range(cfg.n_layers):
        block = f"{LAYER_PREFIX[arch]}{i}."
        names |= {block + theirs for _, theirs, _ in BLOCK_MAPS[arch]} | set(_qkv_names(arch, block))
    if reward:
        names.add(SCORE)
    elif not cfg.tie_embeddings:
        names.add(UNTIED_HEAD[arch])
    return names


def _listing(names) -> str:
    names = sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _split_qkv(hf_state: dict, arch: str, block: str, cfg: GPTConfig) -> tuple[list, list]:
    """One block's (weights, biases) of q, k, v from ``hf_state`` in our layout: (E, E) (out, in) and (E,) each,
    with the rotary rows back in adjacent pairs."""
    e, h = cfg.emb_dim, cfg.n_heads
    if arch == "gpt2":
        w_qkv = hf_state[block + "attn.c_attn.weight"]  # (E, 3E)
        b_qkv = hf_state.get(block + "attn.c_attn.bias", torch.zeros(3 * e))  # (3E,) a file may have none
        weights = [w_qkv[:, j * e:(j + 1) * e].t() for j in range(3)]  # x @ w_qkv = [q | k | v]
        biases = [b_qkv[j * e:(j + 1) * e] for j in range(3)]
        return weights, biases
    if arch == "gpt_neox":
        w_qkv = hf_state[block + "attention.query_key_value.weight"].unflatten(0, (h, 3, -1))  # (H, 3, d_h, E)
        b_qkv = hf_state[block + "attention.query_key_value.bias"].unflatten(0, (h, 3, -1))  # (H, 3, d_h)
        weights, biases = [w_qkv[:, j].flatten(0, 1) for j in range(3)], [b_qkv[:, j].flatten() for j in range(3)]
    else:
        weights = [hf_state[f"{block}self_attn.{p}_proj.weight"] for p in "qkv"]
        biases = [hf_state[f"{block}self_attn.{p}_proj.bias"] for p in "qkv"]
    back = torch.argsort(rope_to_halves(e // h))
    return ([permute_heads(w, h, back) for w in weights[:2]] + weights[2:],
            [permute_heads(b, h, back) for b in biases[:2]] + biases[2:])


def hf_to_gpt_state_dict(hf_state: dict, cfg: GPTConfig, arch: str = "gpt2") -> dict:
    """Map a state dict of ``arch``'s format (base prefix stripped) onto ``GPTModel(cfg)``'s parameter names."""
    ours = {name: hf_state[theirs] for name, theirs in TOP_MAPS[arch]}
    for i in range(cfg.n_layers):
        block, att = f"{LAYER_PREFIX[arch]}{i}.", f"trf_blocks.{i}.att."
        weights, biases = _split_qkv(hf_state, arch, block, cfg)
        for proj, w, b in zip(QKV, weights, biases):
            ours[att + proj + ".weight"] = w.contiguous()  # (E, E) (out, in)
            if cfg.qkv_bias:
                ours[att + proj + ".bias"] = b.contiguous()  # (E,)
        for name, theirs, transposed in BLOCK_MAPS[arch]:
            tensor = hf_state[block + theirs]
            ours[f"trf_blocks.{i}.{name}"] = tensor.t().contiguous() if transposed else tensor
    head = hf_state.get(UNTIED_HEAD[arch])  # a reward model's file has none: its LM head is never read
    ours["out_head.weight"] = ours["tok_emb.weight"] if cfg.tie_embeddings or head is None else head
    return ours


def _has_qkv_bias(hf_state: dict, arch: str, n_layers: int) -> bool:
    """Whether the q/k/v biases are there and not all zero (an export of a model without them writes zeros)."""
    names = [n for i in range(n_layers) for n in _qkv_names(arch, f"{LAYER_PREFIX[arch]}{i}.") if n.endswith(".bias")]
    present = [hf_state[n] for n in names if n in hf_state]
    return bool(present) and any(bool(t.any()) for t in present)


def load_hf_model(path: str, want: str | None = None):
    """Load a local Hugging Face directory (GPT-2, GPT-NeoX or Arcee; causal LM or reward model) into our model,
    in eval mode, on the CPU, in float32.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin`` (or their
            sharded ``*.index.json`` forms): an export of ours, or e.g. a ``hf download ... --local-dir`` of
            uer/gpt2-chinese-cluecorpussmall or gpt2.
        want: "gpt" to insist on a language model, "reward" on a reward model, None for either.
    Returns:
        A ``GPTModel`` whose logits equal the ``transformers`` ``*ForCausalLM``'s, or a ``RewardModel`` whose
        rewards equal ``*ForSequenceClassification``'s (a ``score`` with one label; a head bias our export folded
        is restored from ``config.json``).
    Raises:
        UserError: not a supported directory, the wrong kind of model, a config our model cannot reproduce, unsafe
            or damaged weight files, weights missing or left over (listed by name), or shapes that disagree with
            ``config.json``.
    """
    hf_config = read_hf_config(path)
    arch, where = hf_config["model_type"], os.path.join(path, CONFIG_FILE)
    hf_state = read_hf_state_dict(path, CLASSES[arch][2])
    reward = SCORE in hf_state or any(str(a).endswith("ForSequenceClassification")
                                      for a in hf_config.get("architectures") or [])
    if want == "gpt" and reward:
        raise UserError(f"{path} is a reward model ({CLASSES[arch][1]}); a language model is needed here: export "
                        f"one from a pretrain, SFT or alignment checkpoint")
    if want == "reward" and not reward:
        raise UserError(f"{path} is a language model ({CLASSES[arch][0]}); a reward model is needed here: export "
                        f"one from a 2-RM.py checkpoint")
    if arch == "gpt_neox" and "lm_head.weight" in hf_state and UNTIED_HEAD[arch] not in hf_state:
        hf_state[UNTIED_HEAD[arch]] = hf_state.pop("lm_head.weight")  # transformers 5 saves the head by this name
    n_layers = hf_config.get("n_layer" if arch == "gpt2" else "num_hidden_layers", 0)
    cfg = gpt_config_from_hf(hf_config, _has_qkv_bias(hf_state, arch, n_layers), where)

    expected = _hf_names(cfg, arch, reward)
    if arch == "gpt2" and not cfg.qkv_bias:  # a GPT-2 file may lack c_attn.bias altogether
        expected -= {n for n in expected if n.endswith("c_attn.bias") and n not in hf_state}
    optional = {UNTIED_HEAD[arch], "lm_head.weight"} if cfg.tie_embeddings else set()
    missing = expected - set(hf_state)
    unknown = set(hf_state) - expected - optional - {n for n in hf_state if MASK_BUFFER.fullmatch(n)}
    if missing or unknown:
        problems = ([f"missing {len(missing)} weights ({_listing(missing)})"] if missing else []) + \
                   ([f"{len(unknown)} unknown weights ({_listing(unknown)})"] if unknown else [])
        raise UserError(f"{path}: the weights do not match a {arch} model with {cfg.n_layers} layers as config.json "
                        f"says: {'; '.join(problems)}; download the model again or fix config.json")

    model = GPTModel(cfg)
    ours = hf_to_gpt_state_dict(hf_state, cfg, arch)
    for name, param in model.state_dict().items():
        if ours[name].shape != param.shape:
            raise UserError(f"{path}: {name} has shape {tuple(ours[name].shape)} in the weight file but config.json "
                            f"implies {tuple(param.shape)}; the config and the weights belong to different models")
    if not reward:
        model.load_state_dict(ours, strict=True)
        return model.eval()
    score = hf_state[SCORE]  # (1, E)
    if score.shape != (1, cfg.emb_dim):
        raise UserError(f"{path}: score.weight has shape {tuple(score.shape)}; a reward model scores with one label, "
                        f"(1, {cfg.emb_dim})")
    bias = torch.zeros(1)
    fold = hf_config.get("score_bias_fold")
    if isinstance(fold, dict) and cfg.norm == "layernorm":
        shift = ours["final_norm.shift"]
        j = fold.get("index")
        if isinstance(j, int) and 0 <= j < cfg.emb_dim and float(shift[j]) == fold.get("folded_shift"):
            shift = shift.clone()
            shift[j], bias[0] = fold["shift"], fold["bias"]  # as they were before the export folded b
            ours["final_norm.shift"] = shift
    reward_model = RewardModel(cfg)
    reward_model.backbone.load_state_dict(ours, strict=True)
    reward_model.head.linear.load_state_dict({"weight": score, "bias": bias})
    return reward_model.eval()



def special_token_ids(vocab_size: int) -> dict:
    """bos/eos/pad ids for an exported config: [CLS]/[SEP]/[PAD] for our 21128-id vocabulary; GPT-2's
    ``<|endoftext|>`` (50256) for OpenAI's 50257-id BPE; none for any other vocabulary."""
    if vocab_size == VOCAB_SIZE:
        return {"bos_token_id": CLS_ID, "eos_token_id": SEP_ID, "pad_token_id": PAD_ID}
    if vocab_size == 50257:
        return {"bos_token_id": 50256, "eos_token_id": 50256}
    return {}


def hf_config_from_gpt(cfg: GPTConfig, reward: bool = False) -> dict:
    """The ``config.json`` of the ``transformers`` model that computes ``GPTModel(cfg)``'s function: its
    ``*ForCausalLM``, or with ``reward`` its ``*ForSequenceClassification`` with one label.

    Raises:
        UserError: the configuration has no equivalent (``architecture_for``).
    """
    arch = architecture_for(cfg)
    common = {"architectures": [CLASSES[arch][1 if reward else 0]], "model_type": arch,
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02,
              "use_cache": True, "torch_dtype": "float32", "prompt_starts_with_bos": cfg.bos_id is not None,
              **special_token_ids(cfg.vocab_size)}
    if reward:
        # our batches pad with [PAD] (0) whatever the vocabulary; the score is read at the last other token
        common |= {"num_labels": 1, "id2label": {"0": "reward"}, "label2id": {"reward": 0}, "pad_token_id": PAD_ID}
    if arch == "gpt2":
        return common | {
            "n_positions": cfg.context_length, "n_embd": cfg.emb_dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": cfg.drop_rate,
            "embd_pdrop": cfg.drop_rate, "attn_pdrop": cfg.drop_rate, "summary_first_dropout": 0.0,
            "layer_norm_epsilon": cfg.layer_norm_eps, "scale_attn_weights": True}
    sizes = {"max_position_embeddings": cfg.context_length, "hidden_size": cfg.emb_dim,
             "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
             "intermediate_size": 4 * cfg.emb_dim, "hidden_act": "gelu_pytorch_tanh", "attention_bias": True,
             "attention_dropout": cfg.drop_rate}
    if arch == "gpt_neox":  # both the rotary keys of transformers 4 and the rope_parameters of transformers 5
        return common | sizes | {
            "layer_norm_eps": cfg.layer_norm_eps, "use_parallel_residual": False, "hidden_dropout": cfg.drop_rate,
            "classifier_dropout": 0.0, "rotary_pct": 1.0, "rotary_emb_base": ROPE_BASE,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE, "partial_rotary_factor": 1.0}}
    return common | sizes | {
        "rms_norm_eps": cfg.layer_norm_eps, "mlp_bias": True, "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.emb_dim // cfg.n_heads, "rope_theta": ROPE_BASE,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE}}


def _fold_score_bias(ours: dict, weight, bias: float, cfg: GPTConfig) -> dict | None:
    """Fold the reward head's bias b into the final LayerNorm's shift (``score`` has no bias): at j = argmax |w_j|,
    shift_j += b / w_j, so score = w . LN(x) grows by b. Changes ``ours`` in place and returns what an import
    needs to undo it bit for bit (None when b == 0).

    Raises:
        UserError: b != 0 and the model has RMSNorm (no shift to fold into) or an all-zero score weight.
    """
    if bias == 0.0:
        return None
    j = int(weight.abs().argmax())
    if cfg.norm != "layernorm" or float(weight[j]) == 0.0:
        why = "an RMSNorm model has no shift to hold" if cfg.norm != "layernorm" else "an all-zero head cannot carry"
        raise UserError(f"cannot export this reward model: its head has a bias ({bias:.6g}) that {why}, and "
                        f"transformers' score layer has no bias; train it with LayerNorm or a zero head bias")
    shift = ours["final_norm.shift"].clone()
    old = float(shift[j])
    shift[j] = shift[j] + bias / weight[j]
    ours["final_norm.shift"] = shift
    return {"index": j, "bias": bias, "shift": old, "folded_shift": float(shift[j])}


def qkv_parts(ours: dict, cfg: GPTConfig, block: int, halves: bool) -> tuple[list, list]:
    """Block ``block``'s query, key and value weights [(E, E)] * 3, (out, in), and biases [(E,)] * 3 (zeros
    without ``qkv_bias``) from our state dict ``ours``; with ``halves`` the query and key rows in ``rotate_half``
    order, which pairs dimension i with i + d_h/2 where ours pairs (2i, 2i+1) (``rope_to_halves``)."""
    att = f"trf_blocks.{block}.att."
    weights = [ours[att + p + ".weight"] for p in QKV]
    biases = [ours[att + p + ".bias"] if cfg.qkv_bias else torch.zeros(cfg.emb_dim) for p in QKV]
    if halves:
        order = rope_to_halves(cfg.emb_dim // cfg.n_heads)
        weights[:2] = [permute_heads(w, cfg.n_heads, order) for w in weights[:2]]
        biases[:2] = [permute_heads(b, cfg.n_heads, order) for b in biases[:2]]
    return weights, biases


def gpt_to_hf_state_dict(model) -> tuple[dict, dict | None]:
    """``model``'s weights under the names of its architecture (``architecture_for``; base prefix included), in
    that format's layout, and the record of a folded reward-head bias (``_fold_score_bias``; None if nothing was
    folded). GPT-2 gets Conv1D (in, out) matrices and a fused ``c_attn``; GPT-NeoX a per-head
    ``query_key_value``; rotary models their query/key rows in ``rotate_half`` order. Missing q/k/v biases are
    written as zeros. A ``RewardModel`` adds ``score.weight`` (1, E) and no LM head; a ``GPTModel`` writes its head
    only when untied.
    """
    reward = isinstance(model, RewardModel)
    backbone = model.backbone if reward else model
    cfg, arch = backbone.cfg, architecture_for(backbone.cfg)
    ours = {k: v.detach().to("cpu", torch.float32) for k, v in backbone.state_dict().items()}
    fold = None
    if reward:
        score = model.head.linear.weight.detach().to("cpu", torch.float32)  # (1, E)
        fold = _fold_score_bias(ours, score[0], float(model.head.linear.bias.detach()), cfg)
    prefix = CLASSES[arch][2]
    hf = {prefix + theirs: ours[name] for name, theirs in TOP_MAPS[arch]}
    h = cfg.n_heads
    for i in range(cfg.n_layers):
        block = f"{prefix}{LAYER_PREFIX[arch]}{i}."
        weights, biases = qkv_parts(ours, cfg, i, halves=arch != "gpt2")
        if arch == "gpt2":
            hf[block + "attn.c_attn.weight"] = torch.cat([w.t() for w in weights], dim=1)  # (E, 3E)
            hf[block + "attn.c_attn.bias"] = torch.cat(biases)  # (3E,)
        elif arch == "gpt_neox":
            fused = torch.stack([w.unflatten(0, (h, -1)) for w in weights], dim=1)  # (H, 3, d_h, E)
            hf[block + "attention.query_key_value.weight"] = fused.flatten(0, 2)  # (3E, E)
            hf[block + "attention.query_key_value.bias"] = torch.stack(
                [b.unflatten(0, (h, -1)) for b in biases], dim=1).flatten()  # (3E,)
        else:
            for p, w, b in zip("qkv", weights, biases):
                hf[f"{block}self_attn.{p}_proj.weight"], hf[f"{block}self_attn.{p}_proj.bias"] = w, b
        for name, theirs, transposed in BLOCK_MAPS[arch]:
            tensor = ours[f"trf_blocks.{i}.{name}"]
            hf[block + theirs] = tensor.t() if transposed else tensor
    if reward:
        hf[SCORE] = score
    elif not cfg.tie_embeddings:
        hf[UNTIED_HEAD[arch]] = ours["out_head.weight"]
    return {k: v.contiguous().clone() for k, v in hf.items()}, fold  # own storage each: safetensors refuses sharing


def save_hf_model(model, out_dir: str, tokenizer=None, overwrite: bool = False, chat: bool = False) -> str:
    """Write ``model`` (a ``GPTModel`` or a ``RewardModel``) as a Hugging Face directory of the architecture that
    computes its function (``architecture_for``): ``config.json``, ``model.safetensors``, for a language model
    ``generation_config.json``, and when given the tokenizer, ``chinese_tokenizer.export_tokenizer``'s:
    ``AutoTokenizer`` then encodes and decodes every text as ``chinese_tokenizer`` does (a typed "[SEP]" stays
    text; a plain text gets no ``[SEP]`` at its end, and ``[CLS]`` in front only where ``model.cfg.bos_id`` says
    the model's documents started with it), so ``pipeline("text-generation")`` continues a prompt as
    ``generate.py`` does. With ``chat``
    (a model trained on the chat template: SFT and after) and always for a reward model, the tokenizer carries the
    chat template, so ``apply_chat_template`` builds the prompts it was trained on. The saved tokenizer returns
    ``input_ids`` and ``attention_mask`` only (``MODEL_INPUTS``), so ``model.generate(**batch)`` works.

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` then gives the same logits as ``model``;
    ``AutoModelForSequenceClassification`` the same rewards as a ``RewardModel`` for ``[CLS] prompt [ANS]
    response [SEP]`` (what ``apply_chat_template`` makes of a user turn and an assistant turn), padded left or right
    (with learned positions, left padding needs ``position_ids`` counted from each row's first real token, as
    ``generate`` passes them). For our vocabulary the config says bos = [CLS] (101), eos = [SEP] (102),
    pad = [PAD] (0). The directory is built beside ``out_dir`` and renamed into place, so an interrupted export
    leaves no half-written directory. Returns the ``transformers`` class name written.

    Raises:
        UserError: a configuration without an equivalent, a reward head bias that cannot be folded, ``out_dir``
            exists and ``overwrite`` is false, or the disk write fails.
    """
    reward = isinstance(model, RewardModel)
    config = hf_config_from_gpt(model.cfg, reward)  # refuses what has no equivalent before touching the disk
    if os.path.exists(out_dir) and not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite (overwrite=True) to replace it, or choose "
                        f"another directory")
    if os.path.isfile(out_dir):
        raise UserError(f"{out_dir} is a file; choose a directory path")
    state, fold = gpt_to_hf_state_dict(model)
    if fold is not None:
        config["score_bias_fold"] = fold
    files = {CONFIG_FILE: config}
    if not reward:
        files["generation_config.json"] = {k: v for k, v in config.items() if k.endswith("_token_id")}
    tmp = None
    try:
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        save_file(state, os.path.join(tmp, SAFETENSORS_FILE), metadata={"format": "pt"})
        for name, content in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)
        if tokenizer is not None:
            export_tokenizer(tokenizer, chat_template=chat or reward, add_bos=model.cfg.bos_id is not None,
                             model_input_names=MODEL_INPUTS).save_pretrained(tmp)
        replace_dir(tmp, out_dir)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write {out_dir}: {e.strerror or e}; free some disk space or choose another "
                        f"directory") from e
    return config["architectures"][0]


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


# --------------------------------------------------------------------------------------------------------------
# LoRA adapters as a peft adapter over the exported base model

ADAPTER_CONFIG_FILE, ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model: every adapter name starts so
# our LoRA target (a module path inside a TransformerBlock) -> the module inside a block of each architecture that
# computes it; GPT-2's and GPT-NeoX's q, k and v all land in one fused module
PEFT_MODULES = {
    "gpt2": {"att.W_query": "attn.c_attn", "att.W_key": "attn.c_attn", "att.W_value": "attn.c_attn",
             "att.out_proj": "attn.c_proj", "ff.layers.0": "mlp.c_fc", "ff.layers.2": "mlp.c_proj"},
    "gpt_neox": {"att.W_query": "attention.query_key_value", "att.W_key": "attention.query_key_value",
                 "att.W_value": "attention.query_key_value", "att.out_proj": "attention.dense",
                 "ff.layers.0": "mlp.dense_h_to_4h", "ff.layers.2": "mlp.dense_4h_to_h"},
    "arcee": {"att.W_query": "self_attn.q_proj", "att.W_key": "self_attn.k_proj", "att.W_value": "self_attn.v_proj",
              "att.out_proj": "self_attn.o_proj", "ff.layers.0": "mlp.up_proj", "ff.layers.2": "mlp.down_proj"},
}
ATTENTION_QKV = tuple(f"att.{p}" for p in QKV)


def _lora_settings(settings: dict) -> tuple[int, float, list[str], float]:
    """(rank, alpha, targets, dropout) of a LoRA settings dict ``{"rank", "alpha", "targets", "dropout"}``, checked.

    Raises:
        UserError: a missing key, a rank that is not a positive integer, an alpha that is not a positive number,
            no targets or one that is not a projection of our blocks, a dropout outside [0, 1).
    """
    missing = [k for k in ("rank", "alpha", "targets") if k not in settings]
    if missing:
        raise UserError(f"the LoRA settings lack {', '.join(missing)}; the adapter's checkpoint is incomplete")
    rank, alpha, dropout = settings["rank"], settings["alpha"], settings.get("dropout", 0.0)
    targets = settings["targets"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UserError(f"LoRA rank {rank!r} is not a positive integer; the adapter's checkpoint is damaged")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise UserError(f"LoRA alpha {alpha!r} is not a positive number; the adapter's checkpoint is damaged")
    unknown = [t for t in targets if t not in PEFT_MODULES["gpt2"]]
    if not targets or unknown or len(set(targets)) != len(targets):
        raise UserError(f"LoRA targets {targets} must be distinct names among {', '.join(PEFT_MODULES['gpt2'])}; "
                        f"the adapter's checkpoint is damaged")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise UserError(f"LoRA dropout {dropout!r} is not in [0, 1); the adapter's checkpoint is damaged")
    return rank, alpha, targets, float(dropout)


def _adapter_pairs(cfg: GPTConfig, rank: int, targets: list[str], adapter_state: dict) -> dict:
    """{(block, target): (A (r, in), B (out, r))} from an adapter state dict, float32 on the CPU, names and shapes
    checked against ``cfg`` and the settings.

    Raises:
        UserError: a reward model's adapters (``backbone.`` names), tensors missing or left over, wrong shapes.
    """
    if any(name.startswith("backbone.") for name in adapter_state):
        raise UserError("these are a reward model's adapters: peft's sequence-classification adapters would also "
                        "have to carry the score head, which this export does not write; merge the adapters and "
                        "export the merged reward model")
    e = cfg.emb_dim
    sizes = {"ff.layers.0": (e, 4 * e), "ff.layers.2": (4 * e, e)}  # (in, out); every attention projection (E, E)
    shapes = {}
    for i in range(cfg.n_layers):
        for target in targets:
            n_in, n_out = sizes.get(target, (e, e))
            shapes[f"trf_blocks.{i}.{target}.lora_A"] = (rank, n_in)
            shapes[f"trf_blocks.{i}.{target}.lora_B"] = (n_out, rank)
    missing, unknown = set(shapes) - set(adapter_state), set(adapter_state) - set(shapes)
    if missing or unknown:
        problems = ([f"missing {len(missing)} ({_listing(missing)})"] if missing else []) + \
                   ([f"{len(unknown)} unexpected ({_listing(unknown)})"] if unknown else [])
        raise UserError(f"the adapter tensors do not match rank {rank} on {', '.join(targets)} in {cfg.n_layers} "
                        f"blocks: {'; '.join(problems)}; the adapter belongs to another model or settings")
    wrong = [f"{n} {tuple(adapter_state[n].shape)} (expected {s})" for n, s in shapes.items()
             if tuple(adapter_state[n].shape) != s]
    if wrong:
        raise UserError(f"adapter tensors of the wrong shape: {', '.join(wrong[:4])}; the adapter belongs to another "
                        f"model or settings")
    return {(i, t): tuple(adapter_state[f"trf_blocks.{i}.{t}.lora_{ab}"].detach().to("cpu", torch.float32)
                          for ab in "AB") for i in range(cfg.n_layers) for t in targets}


def peft_adapter(cfg: GPTConfig, settings: dict, adapter_state: dict,
                 base_model_name_or_path: str | None = None) -> tuple[dict, dict]:
    """The ``peft`` form of LoRA adapters trained on ``GPTModel(cfg)``: (``adapter_config.json``'s dict,
    ``adapter_model.safetensors``' tensors), for ``PeftModel.from_pretrained`` over the model ``save_hf_model``
    exports for ``cfg``.

    Args:
        cfg: the base model's configuration (it fixes the architecture, ``architecture_for``).
        settings: ``{"rank": r, "alpha": alpha, "targets": [...], "dropout": p}``.
        adapter_state: ``trf_blocks.{i}.{target}.lora_A`` (r, in) and ``.lora_B`` (out, r) for every block and
            target; each target's weight W (out, in) becomes W + alpha / r * B @ A.
        base_model_name_or_path: written into the config as is (e.g. the exported base directory's name).

    Each of our (A, B) pairs keeps its shapes: peft's ``lora_A.weight`` is (r, in) and ``lora_B.weight`` (out, r),
    Conv1D included (GPT-2's ``fan_in_fan_out`` only transposes the merged delta). Query and key B rows are
    permuted for ``rotate_half`` like the base weights. q/k/v adapters of a fused module (GPT-2 ``c_attn``,
    GPT-NeoX ``query_key_value``) become one LoRA of rank n * r (n adapted parts): A stacked [A_q; A_k; A_v], B
    block-diagonal in the base weight's row order, alpha n * alpha so its scaling stays alpha / r
    (``rank_pattern`` / ``alpha_pattern``); the module docstring shows the layout. peft's dropout then drops the
    fused module's input once where ours drops each projection's input on its own: the same in inference.

    Raises:
        UserError: a configuration without an equivalent, unusable settings, adapter tensors that do not fit them
            or ``cfg`` (named), or a reward model's adapters.
    """
    arch = architecture_for(cfg)
    rank, alpha, targets, dropout = _lora_settings(settings)
    pairs = _adapter_pairs(cfg, rank, targets, adapter_state)
    e, h = cfg.emb_dim, cfg.n_heads
    halves = rope_to_halves(e // h)
    modules = PEFT_MODULES[arch]
    fused = [t for t in ATTENTION_QKV if t in targets] if arch != "arcee" else []  # in q, k, v order
    tensors = {}
    for i in range(cfg.n_layers):
        block = f"{PEFT_PREFIX}{CLASSES[arch][2]}{LAYER_PREFIX[arch]}{i}."
        moved = {}  # target -> (A, B) with B's rows in the base export's order
        for target in targets:
            a, b = pairs[i, target]
            if arch != "gpt2" and target in ATTENTION_QKV[:2]:  # the rows the base export permuted for rotary
                b = permute_heads(b, h, halves)
            moved[target] = a, b
        for target in targets:
            if target not in fused:
                tensors[f"{block}{modules[target]}.lora_A.weight"] = moved[target][0]
                tensors[f"{block}{modules[target]}.lora_B.weight"] = moved[target][1]
        if fused:
            n = len(fused)
            a_fused = torch.cat([moved[t][0] for t in fused])  # (n r, E): [A_q; A_k; A_v] of the adapted ones
            rows = [torch.zeros(e, n * rank) for _ in ATTENTION_QKV]  # each part's rows of B, (E, n r)
            for j, target in enumerate(fused):
                rows[ATTENTION_QKV.index(target)][:, j * rank:(j + 1) * rank] = moved[target][1]
            if arch == "gpt2":  # c_attn's outputs are [q | k | v]
                b_fused = torch.cat(rows)  # (3E, n r)
            else:  # query_key_value's are head by head, [q_h; k_h; v_h]
                b_fused = torch.stack([part.unflatten(0, (h, -1)) for part in rows], dim=1).flatten(0, 2)  # (3E, n r)
            tensors[f"{block}{modules[fused[0]]}.lora_A.weight"] = a_fused
            tensors[f"{block}{modules[fused[0]]}.lora_B.weight"] = b_fused
    fused_module = {modules[fused[0]]: len(fused)} if len(fused) > 1 else {}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": sorted({modules[t] for t in targets}),
        "rank_pattern": {m: n * rank for m, n in fused_module.items()},
        "alpha_pattern": {m: n * alpha for m, n in fused_module.items()},
        "fan_in_fan_out": arch == "gpt2",  # Conv1D stores (in, out): peft transposes the merged delta
        "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True}
    return config, {k: v.contiguous().clone() for k, v in tensors.items()}


def save_peft_adapter(cfg: GPTConfig, settings: dict, adapter_state: dict, out_dir: str,
                      base_model_name_or_path: str | None = None, overwrite: bool = False) -> dict:
    """Write ``peft_adapter``'s two files, ``adapter_config.json`` and ``adapter_model.safetensors``, into
    ``out_dir``, built beside it and renamed into place as ``save_hf_model`` does. Then
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)``, where ``base`` is
    ``save_hf_model``'s export of the base model, gives the logits of the base model with the adapters merged.
    Returns the adapter config written.

    Raises:
        UserError: whatever ``peft_adapter`` refuses (before the disk is touched), ``out_dir`` exists and
            ``overwrite`` is false, or the disk write fails.
    """
    config, tensors = peft_adapter(cfg, settings, adapter_state, base_model_name_or_path)
    if os.path.exists(out_dir) and not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite (overwrite=True) to replace it, or choose "
                        f"another directory")
    if os.path.isfile(out_dir):
        raise UserError(f"{out_dir} is a file; choose a directory path")
    tmp = None
    try:
        parent = os.path.dirname(os.path.abspath(out_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        save_file(tensors, os.path.join(tmp, ADAPTER_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        replace_dir(tmp, out_dir)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write {out_dir}: {e.strerror or e}; free some disk space or choose another "
                        f"directory") from e
    return config
