"""From examples to batches: padding, the response-only labels of chat examples, and the data order.

* ``pad_right`` / ``pad_left``: variable-length id lists -> ``input_ids`` and ``attention_mask``; right padding
  for training and scoring, left padding for prompts that ``generate`` continues together.
* ``chat_example`` / ``ChatPairs`` / ``collate_chat``: (prompt, response) pairs through the chat template into
  supervised fine-tuning examples: ``input_ids = ids[:-1]`` and ``labels = ids[1:]`` kept only where the next token
  belongs to the response (-100 elsewhere), right-padded into batches with an ``attention_mask``.
* ``length_grouped_batches``: examples of similar length grouped into fixed batches, so a batch wastes little
  padding; ``BatchSchedule`` then shuffles whole batches (or examples) as a pure function of (seed, step), so
  resuming at step s continues exactly where the run stopped.
* ``spread_subset``: a fixed evaluation subset spread evenly over a split.
"""

from __future__ import annotations

import torch

from chinese_tokenizer import PAD_ID, SEP_ID, chat_conversation_ids
from plumbing.cli import UserError


def pad_right(sequences, pad_id: int = PAD_ID) -> dict:
    """Lists of ids of any lengths -> {"input_ids": (B, T), "attention_mask": (B, T)}, T the longest length.

    Each row keeps its tokens at positions 0..len-1 and is filled with ``pad_id`` after them; the mask is 1 on
    real tokens and 0 on padding. Raises ``ValueError`` for an empty batch or an empty sequence.
    """
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("pad_right needs at least one sequence and no empty sequence")
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(sequences):
        input_ids[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        attention_mask[row, :len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def pad_left(sequences, pad_id: int = PAD_ID) -> dict:
    """Like ``pad_right`` but padding goes first, so every row ends at the last column: the layout for a batch of
    prompts that ``generate`` continues together. Raises ``ValueError`` for an empty batch or sequence."""
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("pad_left needs at least one sequence and no empty sequence")
    flipped = pad_right([list(reversed(s)) for s in sequences], pad_id)
    return {k: v.flip(dims=[1]) for k, v in flipped.items()}


def chat_example(input_ids: list[int], response_mask: list[int]) -> tuple[list[int], list[int]]:
    """One chat-template sequence -> (inputs, labels) for next-token training on the response only.

    The shift happens here and only here: position t reads ``input_ids[t]`` and is trained to predict
    ``input_ids[t + 1]``, so ``inputs = input_ids[:-1]`` and ``labels[t] = input_ids[t + 1]`` where
    ``response_mask[t + 1]`` is 1, else -100. The ``[ANS]`` position therefore learns the first response token and
    the last response token learns the closing ``[SEP]``; nothing is learned about the prompt.
    ``gpt_model.next_token_loss`` takes these labels as they are (it does not shift again).
    """
    labels = [token if in_response else -100 for token, in_response in zip(input_ids[1:], response_mask[1:])]
    return input_ids[:-1], labels


def collate_chat(examples) -> dict:
    """(inputs, labels) pairs of any lengths -> {"input_ids", "labels", "attention_mask"}, each (B, T).

    Right padding: ``[PAD]`` ids with label -100 and attention 0 after each row's tokens, so padding changes
    neither the real positions' outputs nor the loss.
    """
    batch = pad_right([inputs for inputs, _ in examples])
    labels = torch.full_like(batch["input_ids"], -100)  # (B, T)
    for row, (_, row_labels) in enumerate(examples):
        labels[row, :len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
    batch["labels"] = labels
    return batch


def length_grouped_batches(lengths, batch_size: int) -> list[list[int]]:
    """Example indices sorted by length (ties by index) and cut into consecutive batches of ``batch_size``.

    The grouping is fixed once, so it is a pure function of the data: shuffling the batches (not the examples)
    with a ``BatchSchedule`` keeps exact resume and still pads little. The last batch may be smaller.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


class ChatPairs:
    """Conversations laid out by ``chat_conversation_ids`` as supervised fine-tuning examples: rows of
    ``read_chat_pairs`` (their ``"messages"``), or plain ``{"prompt", "response"}`` rows (one exchange).

    The labels are the assistant turns' tokens (each with its closing ``[SEP]``); every other token has -100.
    ``max_length`` is how many positions the model reads per example (at most its ``context_length``); a
    conversation whose template is longer than ``max_length + 1`` tokens loses its oldest turns, then its system
    text, then the start of its last prompt (its last answer too, from the right, only if that answer alone does
    not fit). Nothing is dropped: ``num_truncated`` counts the cut examples and ``num_response_cut`` those among
    them that lost part of the last answer.

    ``len(pairs)``; ``pairs[i]`` is ``(inputs, labels)`` (lists, see ``chat_example``); ``pairs.lengths[i]`` is
    ``len(inputs)``; ``pairs.collate(indices)`` is a padded batch (see ``collate_chat``).
    """

    def __init__(self, rows, tokenizer, max_length: int):
        if max_length < 3:
            raise ValueError(f"max_length must be >= 3 ([CLS], one prompt token, [ANS]), got {max_length}")
        self.rows, self.max_length = rows, max_length
        self.examples, self.num_truncated, self.num_response_cut = [], 0, 0
        for row in rows:
            turns = row.get("messages") or [("user", row["prompt"]), ("assistant", row["response"])]
            ids, mask, truncated = chat_conversation_ids(turns, tokenizer, max_length + 1)
            self.num_truncated += truncated
            self.num_response_cut += ids[-1] != SEP_ID  # the closing [SEP] is the first thing a response cut loses
            self.examples.append(chat_example(ids, mask))
        self.lengths = [len(inputs) for inputs, _ in self.examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        return self.examples[i]

    def collate(self, indices) -> dict:
        """Example indices -> {"input_ids", "labels", "attention_mask"}, each (B, T), T the longest in the batch."""
        return collate_chat([self.examples[i] for i in indices])

    def truncation_warning(self, what: str) -> str | None:
        """One line saying how many pairs were cut, or None if none was."""
        if not self.num_truncated:
            return None
        response = f", {self.num_response_cut} of them also lost the end of the response" if self.num_response_cut \
            else ""
        # a template of max_length + 1 tokens fills max_length positions: its last token is only a label
        return (f"warning: {self.num_truncated} of {len(self)} {what} pairs do not fit in the {self.max_length} "
                f"positions the model reads; their earliest turns and prompts were cut from the left{response} "
                f"(raise --max_length or shorten them)")


class BatchSchedule:
    """Deterministic data order: epoch ``e`` visits the examples in ``randperm(n)`` seeded by ``seed + e``.

    Global step ``s`` consumes ``batch_size * accumulation * num_processes`` consecutive examples of that endless
    stream; micro-batch ``m`` of process ``r`` takes its own consecutive ``batch_size`` of them.
    """

    def __init__(self, num_examples: int, batch_size: int, accumulation: int, num_processes: int, seed: int):
        if num_examples <= 0:
            raise UserError("the training set is empty; check the data files")
        self.n, self.b, self.acc, self.world, self.seed = num_examples, batch_size, accumulation, num_processes, seed
        self._epoch, self._perm = None, None

    @property
    def global_batch_size(self) -> int:
        return self.b * self.acc * self.world

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        first = step * self.global_batch_size + (micro * self.world + rank) * self.b
        return [self._example(k) for k in range(first, first + self.b)]

    def _example(self, k: int) -> int:
        epoch, pos = divmod(k, self.n)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=generator).tolist()
        return self._perm[pos]


def spread_subset(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)`` (a fixed evaluation subset)."""
    k = min(n, k)
    return [i * n // k for i in range(k)]
