"""A language model out to llama.cpp and ollama: one GGUF file (weights, vocabulary, chat template) and an ollama
``Modelfile`` beside it.

Which llama.cpp architecture computes our model (``gguf_architecture``), the same pairing as the ``transformers``
export (``plumbing/hf_weights.py``):

=============  ====================  =========================================================================
norm           position_embedding    llama.cpp architecture
=============  ====================  =========================================================================
layernorm      learned               ``gpt2``
layernorm      rope (the demo)       ``gptneox`` with ``use_parallel_residual = false`` (sequential residuals,
                                     as ours) and every head dimension rotated
rmsnorm        either                refused: llama.cpp's ``arcee`` (our RMSNorm export for ``transformers``)
                                     computes ReLU^2 without biases, and no other llama.cpp architecture pairs
                                     RMSNorm with a plain (not gated) GELU MLP
=============  ====================  =========================================================================

Tensors (ggml names; a matrix is stored as ours, (out, in), which ggml reads as ``ne = {in, out}``)::

    tok_emb.weight (V, E)                       token_embd.weight
    pos_emb.weight (T, E)                       position_embd.weight              (gpt2 only)
    trf_blocks.i.norm1.scale / shift            blk.i.attn_norm.weight / bias
    att.W_query, W_key, W_value (E, E) each     blk.i.attn_qkv.weight (3E, E) = [q; k; v], bias (3E,)
    att.out_proj                                blk.i.attn_output
    trf_blocks.i.norm2.scale / shift            blk.i.ffn_norm.weight / bias
    ff.layers.0 / ff.layers.2                   blk.i.ffn_up / blk.i.ffn_down
    final_norm.scale / shift                    output_norm.weight / bias
    out_head.weight, or tok_emb.weight (tied)   output.weight                     (gptneox always; gpt2 if untied)

Both architectures add a q/k/v bias (zeros where ``qkv_bias`` is false). For rotary models the query and key rows
move from our adjacent pairs (2i, 2i+1) to llama.cpp's NEOX halves (i, i + d_h/2) within each head, as for
GPT-NeoX in ``transformers`` (``hf_weights.qkv_parts``). GELU: both graphs use ggml's, the tanh form of ours
read from a table of fp16 values (``GgmlGELU``), 1e-3 or so from ours in a trained model's logits.

The vocabulary goes in as llama.cpp's WordPiece tokenizer (``tokenizer.ggml.model = "bert"``), lower-casing and
stripping accents as BERT-Chinese does. llama.cpp marks the start of a word with "▁" where BERT marks the rest of
a word with "##", so a word-initial piece ``x`` is stored as ``▁x`` and a continuation ``##x`` as ``x``. The
characters we keep in reserved slots (newline, space, tab, U+3000, curly quotes, em dash, ellipsis: the
``chinese_tokenizer.CHAR_SLOTS``) are user-defined tokens, which llama.cpp, like ``tokenizers``, cuts out of a text
before anything else, so they encode to our ids; ``[PAD] [UNK] [CLS] [SEP] [MASK] [ANS]`` are control tokens
(read in a text only when asked to parse special tokens, as a chat template is); the other ``[unusedN]`` slots are
unused.

llama.cpp's programs (``llama-cli``, ``llama-server``) tokenize every prompt with its special tokens added, and
its WordPiece tokenizer then wraps it BERT's way, ``bos text sep``, whatever the file's ``add_*_token`` keys say;
llama-cpp-python's ``create_chat_completion`` adds none. For a chat model the file makes both give the prompt
``chat_messages_ids`` makes: sep is [ANS], the token that asks for the answer, and ``GGUF_CHAT_TEMPLATE`` leaves
the last [ANS] to that tokenizer where llama.cpp's programs render it (they, and not llama-cpp-python, set the
variable ``enable_thinking``); with ``add_bos_token`` they also take the template's own [CLS] off before adding
theirs. A pretrained model has no such token: its sep is [SEP], so those programs end every prompt with [SEP] (a
new document starts); text is continued as ours only from ids given without them (llama-cpp-python's
``tokenize(..., add_bos=False)``, or ``llama-server``'s ``/completion`` with a prompt of ids). eos is [SEP]
(102), where generation stops.

llama.cpp's detokenizer writes "▁" as a space, so its text has a space before every Chinese character and every
word ("你 好"); ``decode`` here glues pieces. ``llama_text`` undoes that for a list of ids.

Number formats (``--gguf_type``): ``f32`` keeps every tensor; ``f16`` and ``q8_0`` (blocks of 32 int8 with an f16
scale) apply to the matrices, while the norms, biases and the position table stay f32, as llama.cpp's converter
does. In ``q8_0`` the output head stays f16 (a tied model gets a copy of its embedding as the head): the head
decides the top token, and on the demo's held-out text an 8-bit head changes it at 2.0% of the positions, an f16
head at 0.8% (bench/README.md). The file is written beside its destination and renamed into place.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from chinese_tokenizer import (
    ANSWER_ID,
    ANSWER_TOKEN,
    CHAR_SLOTS,
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    UNK_ID,
    VOCAB_SIZE,
)
from gpt_model import GELU, GPTConfig, RewardModel
from plumbing.cli import UserError
from plumbing.hf_weights import ROPE_BASE, qkv_parts

GGUF_TYPES = ("f32", "f16", "q8_0")
ARCHITECTURES = {("layernorm", "learned"): "gpt2", ("layernorm", "rope"): "gptneox"}
NO_LLAMA_CPP = ("llama.cpp has no architecture for an RMSNorm model of ours: its arcee (the transformers export of "
                "RMSNorm + rotary) computes ReLU^2 without biases, and none of the others pairs RMSNorm with a plain "
                "GELU MLP; a model built with GPTConfig(norm='layernorm') goes there, and this one leaves with --to_hf "
                "(as Arcee)")
CONTROL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ANSWER_TOKEN)
# gguf's key names (``tokenizer.ggml.<name>``) for the special ids
SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                "sep": "seperator_token_id", "pad": "padding_token_id", "mask": "mask_token_id", "cls": "cls_token_id"}
# CHAT_TEMPLATE's layout for llama.cpp, rendering the same text (tests/test_gguf.py) with two differences of form:
# the [ANS] after the last user turn is left out where llama.cpp's programs render it, since their WordPiece
# tokenizer appends sep, [ANS], to the prompt (module docstring; they set enable_thinking for every template,
# llama-cpp-python, which appends nothing, does not); and the system texts are read one message at a time, because
# llama.cpp decides whether a template knows the system role by whether it reads the first message's content, and
# otherwise folds the system text into the first user turn.
GGUF_CHAT_TEMPLATE = (
    "{{- '[CLS]' -}}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{{ message['content'] + ('[SEP]' if loop.last else '\\n') }}"
    "{%- endfor -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{ message['content'] + ('[SEP]' if message['role'] != 'user' else '' if loop.last and enable_thinking is "
    "defined else '[ANS]') }}"
    "{%- endfor -%}"
)
WORD_START = "\u2581"  # llama.cpp's mark of a word-initial WordPiece token (BERT marks the others with "##")
BLOCK = [("norm1.scale", "attn_norm.weight"), ("norm1.shift", "attn_norm.bias"),
         ("att.out_proj.weight", "attn_output.weight"), ("att.out_proj.bias", "attn_output.bias"),
         ("norm2.scale", "ffn_norm.weight"), ("norm2.shift", "ffn_norm.bias"),
         ("ff.layers.0.weight", "ffn_up.weight"), ("ff.layers.0.bias", "ffn_up.bias"),
         ("ff.layers.2.weight", "ffn_down.weight"), ("ff.layers.2.bias", "ffn_down.bias")]


def llama_cpp_architecture(cfg: GPTConfig) -> str:
    """The llama.cpp architecture that computes ``GPTModel(cfg)``'s function (module docstring's table).

    Raises:
        UserError: an RMSNorm model, which has no llama.cpp counterpart, saying why.
    """
    if cfg.norm != "layernorm":
        raise UserError(f"--to_gguf: {NO_LLAMA_CPP}")
    return ARCHITECTURES[(cfg.norm, cfg.position_embedding)]


def gguf_architecture(model) -> str:
    """``llama_cpp_architecture`` of a model; ``UserError`` for a reward model too (llama.cpp runs language
    models)."""
    if isinstance(model, RewardModel):
        raise UserError("--to_gguf: a reward model has no llama.cpp counterpart (llama.cpp runs language models); "
                        "export it with --to_hf")
    return llama_cpp_architecture(model.cfg)


def gguf_tensors(model, own_head: bool = False) -> dict[str, np.ndarray]:
    """``model``'s weights under llama.cpp's names, float32 numpy arrays in the layout of the module docstring.
    ``own_head`` writes ``output.weight`` for a tied GPT-2 too (llama.cpp's gpt2 otherwise reads the embedding).

    Raises:
        UserError: as ``gguf_architecture``.
    """
    arch, cfg = gguf_architecture(model), model.cfg
    ours = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    out = {"token_embd.weight": ours["tok_emb.weight"], "output_norm.weight": ours["final_norm.scale"],
           "output_norm.bias": ours["final_norm.shift"]}
    if arch == "gpt2":
        out["position_embd.weight"] = ours["pos_emb.weight"]
    if not cfg.tie_embeddings:
        out["output.weight"] = ours["out_head.weight"]
    elif arch == "gptneox" or own_head:  # llama.cpp's gptneox always reads a head of its own
        out["output.weight"] = ours["tok_emb.weight"]
    for i in range(cfg.n_layers):
        # NEOX rotary pairs dimension i with i + d_h/2, as transformers' rotate_half does
        weights, biases = qkv_parts(ours, cfg, i, halves=arch == "gptneox")  # (E, E) and (E,) each
        out[f"blk.{i}.attn_qkv.weight"] = torch.cat(weights)  # (3E, E)
        out[f"blk.{i}.attn_qkv.bias"] = torch.cat(biases)  # (3E,)
        for name, theirs in BLOCK:
            out[f"blk.{i}.{theirs}"] = ours[f"trf_blocks.{i}.{name}"]
    return {k: v.contiguous().numpy() for k, v in out.items()}


class GgmlGELU(torch.nn.Module):
    """GELU as llama.cpp computes it on a CPU, to put in our model for comparisons with it: ggml's table of fp16
    values (``ggml-cpu/vec.h``, ``GGML_GELU_FP16``), the tanh GELU of the input rounded to fp16, itself rounded to
    fp16; 0 below -10 and the input above 10. (..., F) -> (..., F)."""

    def forward(self, x):
        table = GELU.reference(x.half().float()).half().float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


def gguf_vocab(tokenizer) -> tuple[list[str], list[int]]:
    """The vocabulary as llama.cpp's WordPiece tokenizer stores it: (token texts, token types), one per id.

    Raises:
        UserError: the tokenizer is not the project's 21128-id vocabulary.
    """
    from gguf import TokenType

    tokens = tokenizer.convert_ids_to_tokens(list(range(VOCAB_SIZE)))
    if len(tokenizer) != VOCAB_SIZE or tokens[CLS_ID] != "[CLS]":
        raise UserError(f"--to_gguf needs the project's {VOCAB_SIZE}-id BERT-Chinese tokenizer")
    chars = set(CHAR_SLOTS.values())
    texts, types = [], []
    for token in tokens:
        if token in CONTROL:
            texts.append(token)
            types.append(TokenType.UNKNOWN if token == "[UNK]" else TokenType.CONTROL)
        elif token in chars:
            texts.append(token)
            types.append(TokenType.USER_DEFINED)
        elif token.startswith("[unused") and token.endswith("]"):
            texts.append(token)
            types.append(TokenType.UNUSED)
        else:
            texts.append(token[2:] if token.startswith("##") else WORD_START + token)
            types.append(TokenType.NORMAL)
    return texts, [int(t) for t in types]


def special_ids(chat: bool) -> dict[str, int]:
    """The special ids the file gives llama.cpp (module docstring): bos [CLS], eos [SEP], unk, pad and mask as
    ours; sep, which llama.cpp's programs put after every prompt, [ANS] for a chat model and [SEP] otherwise."""
    return {"bos": CLS_ID, "eos": SEP_ID, "unk": UNK_ID, "pad": PAD_ID, "mask": MASK_ID, "cls": CLS_ID,
            "sep": ANSWER_ID if chat else SEP_ID}


def llama_text(llm, ids) -> str:
    """``ids`` as text the way ``chinese_tokenizer.decode`` writes it, read from a ``llama_cpp.Llama`` that holds
    one of our GGUF files: llama.cpp's piece of each id, without the space its detokenizer writes for the word mark
    in front of every normal piece (a space, tab or U+3000 of the text is a user-defined token and stays); control
    tokens give nothing and [UNK] stays visible, as in ``decode``."""
    import ctypes

    import llama_cpp

    vocab, buffer, text = llm._model.vocab, ctypes.create_string_buffer(64), []
    for i in ids:
        if i == UNK_ID:
            text.append("[UNK]")
            continue
        normal = bool(llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_NORMAL)
        n = llama_cpp.llama_token_to_piece(vocab, i, buffer, len(buffer), int(normal), False)  # lstrip: the mark
        text.append(buffer.raw[:n].decode("utf-8"))
    return "".join(text)


def _quantized(name: str, array: np.ndarray, gguf_type: str):
    """(data, raw_dtype) for ``add_tensor``: matrices in the chosen type, everything else float32."""
    from gguf import GGMLQuantizationType, quants

    if gguf_type == "f32" or array.ndim != 2 or name == "position_embd.weight":
        return array, None
    if gguf_type == "f16" or name == "output.weight":
        return array.astype(np.float16), None
    if array.shape[1] % 32:
        raise UserError(f"--gguf_type q8_0 needs rows that are a multiple of 32 long; {name} has {array.shape[1]}; "
                        f"use --gguf_type f16")
    return quants.quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def save_gguf(model, path: str, tokenizer, gguf_type: str = "f32", chat: bool = False, name: str = "model",
              overwrite: bool = False) -> str:
    """Write ``model`` (a ``GPTModel``) and ``tokenizer`` as one GGUF file for llama.cpp, written beside ``path``
    and renamed into place. With ``chat`` (a model trained on the chat template) the file carries
    ``GGUF_CHAT_TEMPLATE``, which llama.cpp's Jinja chat path (``--jinja``, llama-cpp-python's chat completion) renders.
    Returns the llama.cpp architecture written.

    Raises:
        UserError: no llama.cpp counterpart (``gguf_architecture``), an unknown ``gguf_type``, ``path`` exists
            without ``overwrite`` or is a directory, or the write fails.
    """
    import gguf

    arch = gguf_architecture(model)  # refuses before touching the disk
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf_type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    if os.path.isdir(path):
        raise UserError(f"--to_gguf {path} is a directory; give a file name such as {os.path.join(path, name)}.gguf")
    if os.path.exists(path) and not overwrite:
        raise UserError(f"--to_gguf {path} already exists; pass --overwrite to replace it, or choose another file")
    cfg: GPTConfig = model.cfg
    tensors = {k: _quantized(k, v, gguf_type) for k, v in gguf_tensors(model, own_head=gguf_type == "q8_0").items()}
    texts, types = gguf_vocab(tokenizer)
    tmp = None
    try:
        tmp = temporary_beside(path)
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(name)
        writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
        if gguf_type == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(cfg.context_length)
        writer.add_embedding_length(cfg.emb_dim)
        writer.add_block_count(cfg.n_layers)
        writer.add_feed_forward_length(4 * cfg.emb_dim)
        writer.add_head_count(cfg.n_heads)
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        if arch == "gptneox":
            writer.add_rope_dimension_count(cfg.emb_dim // cfg.n_heads)  # every dimension of a head rotates
            writer.add_rope_freq_base(ROPE_BASE)
            writer.add_parallel_residual(False)
        writer.add_tokenizer_model("bert")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(texts)
        writer.add_token_types(types)
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)  # BERT-Chinese lower-cases (llama.cpp: off)
        for kind, token in special_ids(chat).items():
            writer.add_uint32(f"tokenizer.ggml.{SPECIAL_KEYS[kind]}", token)
        # what llama.cpp's WordPiece tokenizer does when it adds special tokens: bos first, sep last (docstring)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_sep_token(True)
        if chat:
            writer.add_chat_template(GGUF_CHAT_TEMPLATE)
        for key, (data, raw_dtype) in tensors.items():
            writer.add_tensor(key, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"could not write --to_gguf {path}: {e.strerror or e}; choose a file in a folder you can "
                        f"write to, with room for it") from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    return arch


def temporary_beside(path: str) -> str:
    """An empty temporary file in ``path``'s folder (created if need be), to be renamed to ``path``, readable as
    the umask allows (``mkstemp`` alone makes it private). ``OSError`` when the folder cannot be written."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return tmp


def modelfile_path(gguf_path: str) -> str:
    """Where the ollama ``Modelfile`` of ``gguf_path`` goes: beside it, ``.gguf`` replaced by ``.Modelfile``."""
    return gguf_path.removesuffix(".gguf") + ".Modelfile"


def modelfile(gguf_path: str, chat: bool, context_length: int) -> str:
    """An ollama ``Modelfile`` for the GGUF file at ``gguf_path`` (named relative to the Modelfile's folder): the
    chat layout of ``CHAT_TEMPLATE`` in ollama's Go template for a chat model, the bare prompt otherwise; [SEP] as
    the stop token; the model's context as ollama's (its default is longer than our position table). As llama.cpp's
    programs do (module docstring), the template leaves the first [CLS] and the last [ANS] to the tokenizer, which
    adds them around the prompt; this assumes ollama tokenizes with the special tokens added, as they do."""
    if chat:
        template = ('{{ if .System }}{{ .System }}[SEP]{{ end }}{{ range $i, $m := .Messages }}'
                    '{{ $last := eq (len (slice $.Messages $i)) 1 }}'
                    '{{ if eq .Role "user" }}{{ .Content }}{{ if not $last }}[ANS]{{ end }}'
                    '{{ else if eq .Role "assistant" }}{{ .Content }}[SEP]{{ end }}{{ end }}')
    else:
        template = "{{ .Prompt }}"
    name = os.path.basename(gguf_path)
    return (f"# ollama create NAME -f {os.path.basename(modelfile_path(gguf_path))}, then: ollama run NAME\n"
            f"FROM ./{name}\n"
            f'TEMPLATE """{template}"""\n'
            f'PARAMETER stop "[SEP]"\n'
            f"PARAMETER num_ctx {context_length}\n")
