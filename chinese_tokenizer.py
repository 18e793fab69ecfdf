"""The Chinese tokenizer every stage shares, and the one chat template.

The tokenizer is ``transformers.BertTokenizerFast`` over the exact bert-base-chinese vocabulary (21128 ids), the
vocabulary of ``uer/gpt2-chinese-cluecorpussmall``, so our checkpoints and those public weights are interchangeable.

Two changes make text survive an encode/decode round trip, without growing the vocabulary:

* whitespace that BERT's normaliser would throw away (newline, space, tab, the ideographic space U+3000) takes
  the ids of the reserved slots ``[unused1]`` .. ``[unused4]``, and so do the curly quotes, the em dash and the
  ellipsis, which the vocabulary lacks although Chinese text is full of them (2% of our corpus would be
  ``[UNK]``); the slots are renamed to the characters themselves and registered as added tokens, so the saved
  ``tokenizer.json`` encodes them the same way when it is loaded with ``AutoTokenizer``;
* the decoder concatenates word pieces (dropping the ``##`` continuation mark) instead of joining every token
  with a space, so decode puts no spaces between CJK characters, and spaces between Latin words come back because
  they were encoded as tokens.

What still does not round-trip, by design of the vocabulary: upper case (BERT-Chinese is lower-cased), accents,
and characters outside the vocabulary (they become ``[UNK]``).

Special ids: ``[PAD]=0``, ``[UNK]=100``, ``[CLS]=101`` starts a sequence, ``[SEP]=102`` ends a document or a turn
and is the ``eos_id``; ``[unused5]`` is renamed ``[ANS]`` and separates a prompt from its response.

Our code never lets text become one of these ids (``encode`` reads "[SEP]" typed in a text as the five characters
it is); only the code that lays out a sequence puts them in. ``export_tokenizer`` carries that rule to the tokenizer
that ``load_weight.py --to_hf`` writes for ``transformers``, and ``load_tokenizer`` reads such an export back as the
project tokenizer.
"""

from __future__ import annotations

import json
import os

import torch
from tokenizers import AddedToken, Tokenizer, decoders, processors
from transformers import BertTokenizerFast, PreTrainedTokenizerFast

VOCAB_SIZE = 21128
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 100, 101, 102, 103
EOS_ID = SEP_ID

# reserved vocabulary slot -> the character it stands for
CHAR_SLOTS = {"[unused1]": "\n", "[unused2]": " ", "[unused3]": "\t", "[unused4]": "\u3000",
              "[unused6]": "\u201c", "[unused7]": "\u201d", "[unused8]": "\u2018", "[unused9]": "\u2019",  # “ ” ‘ ’
              "[unused10]": "\u2014", "[unused11]": "\u2026"}  # — …
ANSWER_SLOT, ANSWER_TOKEN = "[unused5]", "[ANS]"
ANSWER_ID = 5
# The layout of chat_messages_ids / chat_conversation_ids as a transformers chat template (Jinja), for exported chat
# models: tokenizer.apply_chat_template(messages) gives the same ids (without their truncation).
CHAT_TEMPLATE = (
    "{{- '[CLS]' -}}"
    "{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | join('\\n') -%}"
    "{%- if system -%}{{ system + '[SEP]' }}{%- endif -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{ message['content'] + ('[ANS]' if message['role'] == 'user' else '[SEP]') }}"
    "{%- endfor -%}"
)


class TokenizerError(ValueError):
    """The tokenizer files are missing or are not the 21128-id BERT-Chinese vocabulary. A user error: the message
    says which files and what to run, and ``plumbing.cli.run`` prints it as one line like any ``UserError`` (this
    module imports nothing of ours, so it cannot subclass that)."""


def build_tokenizer(vocab_file: str) -> BertTokenizerFast:
    """Build the project tokenizer from a bert-base-chinese ``vocab.txt`` (one token per line).

    Raises:
        TokenizerError: the file is missing or does not hold exactly ``VOCAB_SIZE`` tokens.
    """
    if not os.path.isfile(vocab_file):
        raise TokenizerError(f"vocabulary file {vocab_file} not found; run `python data/prepare.py` to fetch it")
    with open(vocab_file, encoding="utf-8") as f:
        tokens = f.read().split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    return _tokenizer_from_tokens(tokens, vocab_file)


def _tokenizer_from_tokens(tokens: list[str], where: str) -> BertTokenizerFast:
    if len(tokens) != VOCAB_SIZE:
        raise TokenizerError(f"{where} holds {len(tokens)} tokens, expected the {VOCAB_SIZE} of bert-base-chinese")
    renames = {**CHAR_SLOTS, ANSWER_SLOT: ANSWER_TOKEN}
    # An explicit vocab dict: in transformers 5.x, BertTokenizer(vocab_file=...) silently builds a 5-token vocab.
    vocab = {renames.get(tok, tok): i for i, tok in enumerate(tokens)}
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True, tokenize_chinese_chars=True)
    tokenizer.add_tokens([AddedToken(ch, normalized=False, special=False) for ch in CHAR_SLOTS.values()])
    tokenizer.add_special_tokens({"additional_special_tokens": [ANSWER_TOKEN]})
    _check(tokenizer, where)
    return _with_concatenating_decoder(tokenizer)


def load_tokenizer(path: str) -> BertTokenizerFast:
    """Load the tokenizer from a directory written by ``save_pretrained``, by ``export_tokenizer`` (read back as the
    project tokenizer, its chat template kept) or holding a plain ``vocab.txt``.

    Raises:
        TokenizerError: nothing loadable there, or the vocabulary is not the project's.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        exported = _exported_tokens(os.path.join(path, "tokenizer.json"))
        if exported is not None:
            tokenizer = _tokenizer_from_tokens(exported, path)
            template = PreTrainedTokenizerFast.from_pretrained(path).chat_template
            tokenizer.chat_template = template and _unmarked(template)
            return tokenizer
        tokenizer = BertTokenizerFast.from_pretrained(path)
        _check(tokenizer, path)
        return _with_concatenating_decoder(tokenizer)
    if os.path.isfile(os.path.join(path, "vocab.txt")):
        return build_tokenizer(os.path.join(path, "vocab.txt"))
    raise TokenizerError(f"no tokenizer in {path}; run `python data/prepare.py` (it writes data/tokenizer/), or "
                         f"point --tokenizer at a folder holding one")


def _check(tokenizer: BertTokenizerFast, where: str) -> None:
    if len(tokenizer) != VOCAB_SIZE:
        raise TokenizerError(f"tokenizer at {where} has {len(tokenizer)} ids, expected {VOCAB_SIZE}")
    ids = tokenizer.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "\n", ANSWER_TOKEN])
    if ids != [PAD_ID, UNK_ID, CLS_ID, SEP_ID, 1, ANSWER_ID]:
        raise TokenizerError(f"tokenizer at {where} is not the project's BERT-Chinese vocabulary (special ids {ids})")


def _with_concatenating_decoder(tokenizer: BertTokenizerFast) -> BertTokenizerFast:
    # BERT's WordPiece decoder joins tokens with spaces ("你 好"); ours glues pieces, dropping "##".
    # WordPiece turns a "word" over 100 characters (a long number, a URL) into one [UNK]; split it instead.
    tokenizer.backend_tokenizer.model.max_input_chars_per_word = 1_000_000
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.Replace("##", ""), decoders.Fuse()])
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def normalize_text(text: str) -> str:
    """Line endings to ``\\n`` (CRLF and CR); everything else is left to the tokenizer."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def encode(text: str, tokenizer: BertTokenizerFast, add_special_tokens: bool = False) -> list[int]:
    """Text -> ids. No ``[CLS]``/``[SEP]`` unless ``add_special_tokens``; "[CLS]" typed in the text is just text.

    This and ``encode_batch`` are the one way text becomes ids, for every path: pretraining documents, SFT, RM and
    DPO pairs, prompts, the server. A special token can only come from the code that lays out a sequence (the chat
    template, the ``[SEP]`` between documents), never from what a user or a corpus wrote."""
    return encode_batch([text], tokenizer, add_special_tokens)[0]


def encode_batch(texts, tokenizer: BertTokenizerFast, add_special_tokens: bool = False) -> list[list[int]]:
    """Many texts -> their ids by the rule of ``encode``, in one call of the fast tokenizer (which spreads a batch
    over the CPU's cores): line ends normalised, a special token's name in the text read as plain text."""
    return tokenizer([normalize_text(t) for t in texts], add_special_tokens=add_special_tokens,
                     split_special_tokens=True)["input_ids"]


def tokenizer_fingerprint(tokenizer: BertTokenizerFast) -> str:
    """The sha256 of everything that decides which ids a text gets: the fast tokenizer's whole serialized state
    (``tokenizer.json``: vocabulary, normaliser with its lower-casing and accent settings, pre-tokeniser, added
    tokens, the word-piece limits). Two tokenizers with the same fingerprint encode every text alike."""
    import hashlib

    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()


def decode(ids, tokenizer: BertTokenizerFast, skip_special_tokens: bool = True) -> str:
    """Ids (list or 1-D tensor) -> text; special tokens dropped unless asked. ``[UNK]`` stays visible."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if skip_special_tokens:
        ids = [i for i in ids if i not in (PAD_ID, CLS_ID, SEP_ID, ANSWER_ID, MASK_ID)]
    return tokenizer.decode(ids, skip_special_tokens=False)


def text_to_token_ids(text: str, tokenizer: BertTokenizerFast):
    """Text -> (1, T) LongTensor of ids, with no [CLS]/[SEP] added (the seed's helper, as a batch of one)."""
    return torch.tensor(encode(text, tokenizer), dtype=torch.long).unsqueeze(0)  # (1, T)


def token_ids_to_text(token_ids, tokenizer: BertTokenizerFast) -> str:
    """(1, T) or (T,) ids -> text, special tokens dropped, no spaces between CJK characters."""
    return decode(token_ids.reshape(-1), tokenizer)


def until_eos(ids: list[int]) -> list[int]:
    """The ids before the first ``[SEP]`` (the end of a document or of an answer): all of them if there is none."""
    return ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids


def chat_prompt_ids(prompt, tokenizer: BertTokenizerFast, max_length: int | None = None) -> list[int]:
    """The prompt half of the chat template: ``[CLS] prompt [ANS]``; the model continues with the response.

    With ``max_length`` (>= 3), a longer prompt loses its beginning; ``[CLS]`` and ``[ANS]`` always stay.
    ``prompt`` may also be a conversation, ``(role, content)`` pairs ending with a user turn: it is laid out by
    ``chat_messages_ids`` (which gives exactly this layout for one user turn).
    """
    if not isinstance(prompt, str):
        return chat_messages_ids(list(prompt), tokenizer, max_length)
    prompt_ids = encode(prompt, tokenizer)
    if max_length is not None:
        if max_length < 3:
            raise ValueError(f"max_length must be >= 3 ([CLS], [ANS] and one token), got {max_length}")
        prompt_ids = prompt_ids[-(max_length - 2):]
    return [CLS_ID] + prompt_ids + [ANSWER_ID]


def apply_chat_template(
    prompt, response: str, tokenizer: BertTokenizerFast, max_length: int | None = None
) -> tuple[list[int], list[int], bool]:
    """Turn one (prompt, response) pair into ids and a mask of the response positions.

    ``prompt`` is a string, or a whole conversation before the response as ``(role, content)`` pairs ending with a
    user turn; a conversation goes through ``chat_conversation_ids`` with the response as its last assistant turn
    (only that turn in the mask), so a reward model or DPO reads several turns the way SFT writes them.

    Layout: ``[CLS] prompt [ANS] response [SEP]``. ``response_mask[i] == 1`` where ``input_ids[i]`` belongs to the
    response (its tokens and the closing ``[SEP]``, which is what the model must learn to emit). If the pair is
    longer than ``max_length``, the prompt is cut from its left (the end of the prompt, nearest to the answer,
    matters most); if even the response alone does not fit, the response is cut from its right.

    Raises:
        ValueError: ``max_length`` < 3 (no room for ``[CLS]``, ``[ANS]`` and one token).

    Returns:
        ``(input_ids, response_mask, truncated)``: two lists of equal length L <= max_length, and whether anything
        was cut.
    """
    if not isinstance(prompt, str):
        input_ids, mask, truncated = chat_conversation_ids(list(prompt) + [("assistant", response)], tokenizer,
                                                           max_length)
        last = len(mask) - mask[::-1].index(0)  # the response: the mask's last run of ones
        return input_ids, [0] * last + mask[last:], truncated
    prompt_ids = encode(prompt, tokenizer)
    response_ids = encode(response, tokenizer) + [SEP_ID]
    truncated = False
    if max_length is not None:
        if max_length < 3:
            raise ValueError(f"max_length must be >= 3 ([CLS], [ANS] and one token), got {max_length}")
        room = max_length - 2  # [CLS] and [ANS]
        keep_prompt = 1 if prompt_ids else 0  # a prompt keeps at least its last token
        if len(response_ids) > room - keep_prompt:
            response_ids = response_ids[: room - keep_prompt]
            truncated = True
        if len(prompt_ids) + len(response_ids) > room:
            prompt_ids = prompt_ids[len(prompt_ids) + len(response_ids) - room:]
            truncated = True
    input_ids = [CLS_ID] + prompt_ids + [ANSWER_ID] + response_ids
    response_mask = [0] * (len(prompt_ids) + 2) + [1] * len(response_ids)
    return input_ids, response_mask, truncated


def split_conversation(messages, last: str) -> tuple[str, list[str]]:
    """``messages`` as ``(role, content)`` pairs -> (the system text, the user/assistant texts in order).

    System messages may only come first (several are joined by newlines); then user and assistant turns alternate,
    starting with a user turn and ending with a ``last`` one ("user": a prompt to answer; "assistant": a training
    example). Raises ``ValueError`` naming the first message out of place.
    """
    messages = list(messages)
    system = []
    while messages and messages[0][0] == "system":
        system.append(messages.pop(0)[1])
    if not messages:
        raise ValueError("the conversation has no user message: end it with a user turn for the model to answer"
                         if last == "user" else "the conversation has no user and assistant turns")
    for i, (role, _) in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            where = f"message {len(system) + i + 1} has role {role!r}"
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"{where}; use system, user or assistant")
            raise ValueError(f"{where} but {expected!r} is due: system messages come first, then user and "
                             f"assistant turns alternate")
    if messages[-1][0] != last:
        raise ValueError("the conversation ends with an assistant turn: end it with the user turn to answer"
                         if last == "user" else "the conversation ends with a user turn: end it with the "
                                                "assistant's answer to learn")
    return "\n".join(system), [text for _, text in messages]


def chat_messages_ids(messages, tokenizer: BertTokenizerFast, max_length: int | None = None) -> list[int]:
    """The prompt of a whole conversation, for the model to write the next assistant turn.

    ``messages`` is a list of ``(role, content)`` pairs: optional ``system`` messages first, then ``user`` and
    ``assistant`` turns in alternation, ending with a ``user`` turn. Layout::

        [CLS] system [SEP] user_1 [ANS] assistant_1 [SEP] user_2 [ANS] ... user_n [ANS]

    Each user turn ends with ``[ANS]`` and each assistant turn with ``[SEP]``, as a response does in
    ``apply_chat_template``; a system text (several are joined by newlines) sits before the first user turn and
    ends with ``[SEP]``, so it is the only text before the first ``[ANS]`` that a ``[SEP]`` closes. One user turn
    with no system text gives exactly ``chat_prompt_ids``: the layout SFT trains on.

    With ``max_length`` (>= 3) a longer conversation first loses its oldest (user, assistant) pairs, then its
    system text, then the beginning of the last user turn; ``[CLS]`` and the final ``[ANS]`` always stay.

    Raises:
        ValueError: no user turn, a role out of order (the message says which one), an unknown role, or
            ``max_length`` < 3.
    """
    system, texts = split_conversation(messages, last="user")
    if max_length is not None and max_length < 3:
        raise ValueError(f"max_length must be >= 3 ([CLS], [ANS] and one token), got {max_length}")
    head = encode(system, tokenizer) + [SEP_ID] if system else []
    turns = [encode(text, tokenizer) + [SEP_ID if i % 2 else ANSWER_ID] for i, text in enumerate(texts)]
    pairs = [turns[i] + turns[i + 1] for i in range(0, len(turns) - 1, 2)]  # (user, assistant) before the last
    last = turns[-1]
    if max_length is not None:
        room = max_length - 1  # [CLS]
        while pairs and len(head) + sum(map(len, pairs)) + len(last) > room:
            pairs.pop(0)
        if head and len(head) + len(last) > room:
            head = []
        last = last[-room:]  # the end of the last user turn, its [ANS] included
    return [CLS_ID] + head + [token for pair in pairs for token in pair] + last


def chat_conversation_ids(messages, tokenizer: BertTokenizerFast,
                          max_length: int | None = None) -> tuple[list[int], list[int], bool]:
    """A whole conversation as a training example: ids and a mask of the tokens the model must learn to write.

    ``messages``: ``(role, content)`` pairs as for ``chat_messages_ids``, but ending with an ``assistant`` turn.
    The layout is the same, each assistant turn followed by its ``[SEP]``::

        [CLS] system [SEP] user_1 [ANS] assistant_1 [SEP] ... user_n [ANS] assistant_n [SEP]

    ``assistant_mask[i] == 1`` on every assistant turn's tokens and its closing ``[SEP]``; the system text and the
    user turns are context only. One (user, assistant) pair with no system text gives exactly
    ``apply_chat_template`` (ids, mask and truncation): the layout of ``{"prompt", "response"}`` rows.

    Longer than ``max_length``: the oldest (user, assistant) pairs go first, then the system text; a last pair that
    still does not fit is cut by ``apply_chat_template``'s rule (the user turn from its left, then the answer
    from its right).

    Raises:
        ValueError: a conversation out of order (see ``split_conversation``) or ``max_length`` < 3.

    Returns:
        ``(input_ids, assistant_mask, truncated)``.
    """
    system, texts = split_conversation(messages, last="assistant")
    if max_length is not None and max_length < 3:
        raise ValueError(f"max_length must be >= 3 ([CLS], [ANS] and one token), got {max_length}")
    head = encode(system, tokenizer) + [SEP_ID] if system else []
    pairs = [(encode(texts[i], tokenizer) + [ANSWER_ID], encode(texts[i + 1], tokenizer) + [SEP_ID])
             for i in range(0, len(texts), 2)]
    truncated = False

    def length():
        return 1 + len(head) + sum(len(user) + len(reply) for user, reply in pairs)

    if max_length is not None:
        while len(pairs) > 1 and length() > max_length:
            pairs.pop(0)
            truncated = True
        if head and length() > max_length:
            head, truncated = [], True
        if length() > max_length:  # one pair that does not fit alone
            ids, mask, _ = apply_chat_template(texts[-2], texts[-1], tokenizer, max_length)
            return ids, mask, True
    input_ids, mask = [CLS_ID] + head, [0] * (1 + len(head))
    for user, reply in pairs:
        input_ids += user + reply
        mask += [0] * len(user) + [1] * len(reply)
    return input_ids, mask, truncated


class IncrementalDecoder:
    """Text that grows with the tokens of one answer: ``push(id)`` returns the text the new token added.

    Each call decodes all the tokens so far and returns only what is new, so a token whose text depends on its
    neighbours (a ``##`` word piece, or any tokenizer that merges pieces) still comes out right; ``text`` is the
    whole decoded answer.
    """

    def __init__(self, tokenizer: BertTokenizerFast):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = decode(self.ids, self.tokenizer)
        if not (text.startswith(self.text) and len(text) > len(self.text)):
            return ""  # nothing new yet (or a merge changed earlier text: keep what was already given out)
        new, self.text = text[len(self.text):], text
        return new


# An exported tokenizer (export_tokenizer) names the control tokens with this character in front: a code point of
# Unicode's supplementary private use area, which no text carries and which BERT's normaliser deletes from text, so
# "[SEP]" typed by a user is plain text there as it is for ``encode``. [UNK] is not a control token: the model reads
# it for a character it lacks, and it stays a plain entry of the vocabulary, visible when decoded.
EXPORT_MARK = "\U000F1000"
CONTROL_TOKENS = {PAD_ID: "[PAD]", ANSWER_ID: ANSWER_TOKEN, CLS_ID: "[CLS]", SEP_ID: "[SEP]", MASK_ID: "[MASK]"}


def _exported_tokens(json_file: str) -> list[str] | None:
    """The vocabulary of an ``export_tokenizer`` file, in id order and under our names; None for any other file."""
    try:
        with open(json_file, encoding="utf-8") as f:
            vocab = json.load(f)["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{json_file} is not a readable tokenizer file ({e}); export it again or point "
                             f"--tokenizer at data/tokenizer") from e
    if not isinstance(vocab, dict) or EXPORT_MARK + "[SEP]" not in vocab:
        return None
    tokens = sorted(vocab, key=vocab.get)
    return [_unmarked(token) for token in tokens]


def _unmarked(text: str) -> str:
    return text.replace(EXPORT_MARK, "")


def export_tokenizer(tokenizer: BertTokenizerFast, chat_template: bool, add_bos: bool,
                     model_input_names=("input_ids", "attention_mask")) -> PreTrainedTokenizerFast:
    """The project tokenizer as ``transformers`` should read it from an exported model directory: for every text,
    ``tokenizer(text)`` gives the ids ``encode`` gives (after ``[CLS]`` when ``add_bos``, as ``generate.py``
    prompts a model whose documents started with it), ``apply_chat_template`` the ids of ``chat_messages_ids`` /
    ``chat_conversation_ids``, and ``decode`` the text of ``decode`` (no spaces between Chinese characters).

    BERT's tokenizer matches the names of its special tokens in the text ("你好[SEP]" gives a real end of turn) and
    wraps every text in ``[CLS] ... [SEP]``. Here the five control tokens (``CONTROL_TOKENS``) keep their ids under
    the names ``EXPORT_MARK + "[SEP]"`` and so on, so typed names stay text; the chat template writes the marked
    names; nothing is added around a text but the optional ``[CLS]``; the decoder glues word pieces. What cannot
    match ``encode``: a text that itself contains ``EXPORT_MARK`` before a control token's name (``encode`` deletes
    the mark and reads the name as text; the export reads a control token). The class is ``transformers``' generic
    fast tokenizer, which takes ``tokenizer.json`` as written (``BertTokenizer`` would rebuild BERT's pipeline).

    Args:
        tokenizer: the project tokenizer (``load_tokenizer``); left unchanged.
        chat_template: store ``CHAT_TEMPLATE`` (a model trained on it: SFT and after, and reward models).
        add_bos: ``tokenizer(text)`` starts with ``[CLS]`` (``GPTConfig.bos_id`` is set: uer's weights).
        model_input_names: what ``tokenizer(...)`` returns.

    Returns:
        A ``PreTrainedTokenizerFast``; ``save_pretrained`` writes it, ``load_tokenizer`` reads it back.
    """
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    marked = {name: EXPORT_MARK + name for name in CONTROL_TOKENS.values()}
    for name in CONTROL_TOKENS.values():
        vocab[marked[name]] = vocab.pop(name)
    state["added_tokens"] = [{**token, "content": marked.get(token["content"], token["content"])}
                             for token in state["added_tokens"] if token["id"] != UNK_ID]
    cls = marked["[CLS]"]
    state["post_processor"] = json.loads(processors.TemplateProcessing(
        single=f"{cls}:0 $A:0" if add_bos else "$A:0", pair=f"{cls}:0 $A:0 $B:1" if add_bos else "$A:0 $B:1",
        special_tokens=[(cls, CLS_ID)]).__getstate__())  # tokenizer.json readers (tokenizers, transformers.js) use it
    template = CHAT_TEMPLATE
    for name in ("[CLS]", "[SEP]", ANSWER_TOKEN):
        template = template.replace(name, marked[name])
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)), bos_token=cls, cls_token=cls,
        eos_token=marked["[SEP]"], sep_token=marked["[SEP]"], pad_token=marked["[PAD]"], mask_token=marked["[MASK]"],
        extra_special_tokens=[marked[ANSWER_TOKEN]], add_bos_token=add_bos, add_eos_token=False,
        chat_template=template if chat_template else None, model_input_names=list(model_input_names),
        clean_up_tokenization_spaces=False)
