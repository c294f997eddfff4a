"""Preference pairs: a prompt with a chosen and a rejected response, one pair per row.

    --train_dataset.preference.enabled=True --train_dataset.json_dataset.path=pairs.jsonl

Formats (docs/preference.md shows each):
- strings: {"prompt": str, "chosen": str, "rejected": str}. Each side is tokenized as
  text_processor.fields='[prompt],chosen' would be: BOS (add_bos_token), prepend_text and
  the prompt, the response, EOS (add_eos_token).
- chat (text_processor.chat=True), rendered with the chat template: `chosen` and
  `rejected` are whole conversations (message lists whose shared first messages are the
  prompt, as in UltraFeedback-binarized), or only the replies (a string, or messages
  starting with an assistant one) after `prompt` (a string: one user message; or
  messages).
Only the responses get loss: the response tokens (and EOS), or in chat mode the assistant
messages after the shared conversation.

Truncation: the prompt is kept whole and each response is cut at its end so that each
side fits one row of seq_length + 1 tokens; such pairs count in dataset_truncated_pairs.
A prompt longer than seq_length would leave no response token: that pair is skipped.

Layout: pair i of a batch is row i of the chosen_* and of the rejected_* arrays (b, T), so
both sides are on one host, on one device whatever the batch sharding, and in one
micro-batch. Row r takes the pairs of slots r, r+B, r+2B, ... (sources.py), one pair per
batch, never packed or split; its state is its next slot (offset 0), so resuming, process
shares and shuffling are dataset.py's. Bad pairs (a missing or non-text field, chosen
equal to rejected, a prompt longer than seq_length) are skipped, counted and warned
about with their file and line, or with strict=True stop the run with that line.
"""

import collections
import logging

import numpy as np
from ml_collections import ConfigDict

from easylm.data.rows import restore_size
from easylm.data.sources import open_source
from easylm.data.text import TextProcessor, is_messages
from easylm.errors import UserError

SIDES = ("chosen", "rejected")
_MAX_WARNINGS = 10
logger = logging.getLogger(__name__)


class PreferenceProcessor:
    """Examples -> pairs (chosen tokens, masks, rejected tokens, masks, truncated), each
    side cut to seq_length + 1 tokens; or None / a skip reason, as TextProcessor.process."""

    HELP = {
        "enabled": "examples are preference pairs: batches hold chosen_* and rejected_* "
                   "rows, one pair per row and batch_size pairs (docs/preference.md)",
        "prompt_field": "the field holding the prompt: text, or chat messages",
        "chosen_field": "the field holding the chosen response: text, or chat messages",
        "rejected_field": "the field holding the rejected response: text, or chat messages",
    }

    @staticmethod
    def get_default_config(updates=None):
        config = ConfigDict(dict(enabled=False, prompt_field="prompt", chosen_field="chosen",
                                 rejected_field="rejected"))
        if updates is not None:
            config.update(ConfigDict(updates).copy_and_resolve_references())
        return config

    def __init__(self, config, text_processor, tokenizer, seq_length, images=None):
        """images: an image-text model's `image_chats` object, whose chats' image parts it
        reads (chat mode only): then each side also carries its images' encodings, and
        seq_length None gives each pair's sides whole, as one document (`whole_pair`: what
        a token cache of image pairs holds; `fit` cuts it to a run's rows)."""
        self.config = self.get_default_config(config)
        self.images = images
        self.row_length = None if seq_length is None else seq_length + 1
        self.chat = bool(text_processor.chat)
        # The internal example {"prompt", "response"} of each side, tokenized EasyLM's way.
        text = ConfigDict(text_processor.to_dict())
        text.fields, text.fields_from_example = "[prompt],response", ""
        self.text = TextProcessor(text, tokenizer)
        # Each side tokenized whole, to count the pairs it differs for (see _count_split).
        text.fields = "text"
        self.whole = None if self.chat else TextProcessor(text, tokenizer)
        self.split = set()   # where each such pair is (file:line), each counted once

    def process(self, examples):
        plans, sides = [], []
        for example, where in examples:
            if not isinstance(example, dict):
                plans.append(example)
                continue
            pair = self._chat_sides(example, where) if self.chat else \
                self._text_sides(example, where)
            if isinstance(pair, str):
                plans.append(pair)
                continue
            plans.append((len(sides), where))
            sides += pair
        if self.images is not None:
            encoded = [self._with_images(*side) for side in sides]
        else:
            encoded = (self.text.encode_chats if self.chat else self.text.process)(sides)
        if not self.chat:
            self._count_split(sides, encoded)
        if self.row_length is None:
            return [whole_pair(plan, encoded) for plan in plans]
        return [self._pair(plan, encoded) for plan in plans]

    def fit_document(self, document, where):
        """A whole image pair (`whole_pair`'s document) as a pair of this run's rows, or
        the reason it is skipped."""
        tokens, masks, encoded, (split, images) = document
        tokens, masks = tokens.astype(np.int32), masks.astype(np.float32)
        sides = [(tokens[:split], masks[:split], encoded[:images]),
                 (tokens[split:], masks[split:], encoded[images:])]
        return self._pair((0, where), sides)

    def _with_images(self, conversation, shared, where):
        """(tokens, masks, the images' encodings) of one side of an image pair, or why not."""
        from easylm.data.images import chat_images, data_folder

        try:
            images = chat_images(conversation, where, data_folder(where))
            return self.images.encode_chat(self.text, conversation, images, where,
                                           first=shared)
        except UserError as e:
            return str(e)

    def _count_split(self, sides, encoded):
        """Pairs whose prompt tokens, tokenized alone (as they train: the prompt is the
        model's context whatever the response), are not how the side tokenized whole
        begins: the prompt's last token merges with the response's first (e.g. a prompt
        ending in a space). TRL tokenizes apart too, and such pairs are worth knowing of:
        warned once per pair with its file and line, and counted (`split_pairs`, which the
        preview prints; the reader reads ahead and repeats epochs, so a set of places)."""
        wholes = self.whole.process([({"text": side["prompt"] + side["response"]}, where)
                                     for side, where in sides])
        for i in range(0, len(sides), 2):
            apart, whole, where = encoded[i], wholes[i], sides[i][1]
            if isinstance(apart, str) or isinstance(whole, str) or where in self.split:
                continue
            prompt = int(np.argmax(apart[1] > 0))   # the prompt's tokens (and BOS)
            if np.array_equal(apart[0][:prompt], whole[0][:prompt]):
                continue
            self.split.add(where)
            if self.split_pairs <= _MAX_WARNINGS:
                logger.warning(
                    "%s: the prompt's last token merges with the response's first when "
                    "tokenized together (a prompt ending in a space?); trained apart: the "
                    "prompt's own tokens, then the response's%s", where,
                    " (further ones are only counted)" if self.split_pairs == _MAX_WARNINGS
                    else "")

    @property
    def split_pairs(self) -> int:
        return len(self.split)

    def _fields(self, example, where, names):
        """The values of the named fields, or the reason the example is skipped."""
        missing = [name for name in names if name not in example]
        if missing:
            return (f"{where}: missing field {missing[0]!r}; the example has: "
                    f"{', '.join(map(str, example)) or 'no fields'}")
        return [example[name] for name in names]

    def _text_sides(self, example, where):
        c = self.config
        values = self._fields(example, where, (c.prompt_field, c.chosen_field,
                                               c.rejected_field))
        if isinstance(values, str):
            return values
        for name, value in zip((c.prompt_field, c.chosen_field, c.rejected_field), values):
            if not isinstance(value, str):
                return (f"{where}: field {name!r} is {type(value).__name__}, expected text "
                        f"(or set text_processor.chat=True for messages)")
        prompt, chosen, rejected = values
        if chosen == rejected:
            return f"{where}: chosen and rejected are the same"
        return [({"prompt": prompt, "response": response}, where)
                for response in (chosen, rejected)]

    def _chat_sides(self, example, where):
        c = self.config
        values = self._fields(example, where, (c.chosen_field, c.rejected_field))
        if isinstance(values, str):
            return values
        conversations = []
        for name, value in zip((c.chosen_field, c.rejected_field), values):
            if isinstance(value, str):
                value = [{"role": "assistant", "content": value}]
            elif not is_messages(value, self.images is not None) or not value:
                return (f"{where}: field {name!r} must be text or a non-empty list of "
                        f"{{\"role\": str, \"content\": str}} objects")
            if value[0]["role"] == "assistant":   # only the replies: the prompt goes first
                prompt = self._chat_prompt(example, where)
                if isinstance(prompt, str):
                    return prompt
                value = prompt + value
            conversations.append(value)
        chosen, rejected = conversations
        if chosen == rejected:
            return f"{where}: chosen and rejected are the same"
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b),
                      min(len(chosen), len(rejected)))
        for name, conversation in zip(SIDES, conversations):
            if shared == len(conversation):
                return (f"{where}: the {name} conversation has no reply after the "
                        f"{shared} messages it shares with the other")
            if conversation[shared]["role"] != "assistant":
                return (f"{where}: chosen and rejected differ at message {shared + 1}, which "
                        f"is a {conversation[shared]['role']!r} message, not an assistant "
                        f"reply")
        return [(conversation, shared, where) for conversation in conversations]

    def _chat_prompt(self, example, where):
        name = self.config.prompt_field
        if name not in example:
            return (f"{where}: missing field {name!r} (chosen and rejected hold only the "
                    f"replies); the example has: {', '.join(map(str, example))}")
        prompt = example[name]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if not is_messages(prompt, self.images is not None):
            return (f"{where}: field {name!r} must be text or a list of "
                    f"{{\"role\": str, \"content\": str}} objects")
        return prompt

    def _pair(self, plan, encoded):
        if not isinstance(plan, tuple):
            return plan
        first, where = plan
        sides = []
        for name, side in zip(SIDES, encoded[first:first + 2]):
            if isinstance(side, str):
                return side
            tokens, masks, *pictures = side
            if pictures:   # an image's tokens are never cut
                from easylm.data.images import images_fit

                cut = images_fit(tokens, self.images.image_token_id, self.row_length, where)
                if cut:
                    return cut
            if not masks[1:].any():   # the first token is never a target
                return f"{where}: the {name} response has no tokens to train on"
            trained = masks[1:self.row_length].any()
            if not trained:
                prompt = int(np.argmax(masks[1:] > 0)) + 1
                return (f"{where}: the prompt is {prompt} tokens, longer than "
                        f"seq_length={self.row_length - 1}")
            sides.append((tokens[:self.row_length], masks[:self.row_length], len(tokens),
                          pictures))
        (chosen, chosen_masks, n, chosen_images), (rejected, rejected_masks, m,
                                                   rejected_images) = sides
        if np.array_equal(chosen, rejected) and np.array_equal(chosen_masks, rejected_masks) \
                and not chosen_images:
            return (f"{where}: chosen and rejected differ only after seq_length="
                    f"{self.row_length - 1} tokens")
        # An image pair also carries each side's images' encodings.
        return (chosen, chosen_masks, rejected, rejected_masks,
                max(n, m) > self.row_length, *chosen_images, *rejected_images)


def whole_pair(plan, encoded):
    """A pair's sides whole as one document (tokens, masks, encodings, (where the rejected
    side's tokens start, its images)), or the reason it is skipped."""
    if not isinstance(plan, tuple):
        return plan
    first, _ = plan
    sides = encoded[first:first + 2]
    reason = next((side for side in sides if isinstance(side, str)), None)
    if reason is not None:
        return reason
    (chosen, chosen_masks, chosen_images), (rejected, rejected_masks, rejected_images) = sides
    return (np.concatenate([chosen, rejected]).astype(np.int32),
            np.concatenate([chosen_masks, rejected_masks]).astype(np.float32),
            chosen_images + rejected_images,
            np.asarray([len(chosen), len(chosen_images)], np.int64))


def open_pairs(config, loader, tokenizer, images=None):
    """(source, PreferenceProcessor) for a DatasetFactory config with preference.enabled;
    `images`: an image-text model's reader of image chats (chat mode), whose pairs may
    also come from a token cache."""
    sources = ("json", "huggingface") + (("cache",) if images is not None else ())
    if config.type not in sources:
        raise UserError(f"--train_dataset.preference.enabled=True reads pairs from a "
                        f"{', '.join(sources[:-1])} or {sources[-1]} source, not "
                        f"--train_dataset.type={config.type}")
    if loader.segment_ids:
        raise UserError("segment_ids=True: preference pairs are not packed (one pair per "
                        "row), so there are no segments; set it to False")
    # A token cache of image pairs (built with --family) holds whole pairs, which the
    # processor fits to this run's rows (`fit_document`) as they are read.
    source, _ = open_source(config.type, loader, config.text_processor, tokenizer,
                            loader.strict, images, config.preference)
    return source, PreferenceProcessor(config.preference, config.text_processor, tokenizer,
                                       loader.seq_length, images)


class Pairs:
    """The row kind of preference pairs (rows.py): one pair per row, never packed; each
    row counts its truncated pairs."""

    marker, counters = "pairs", "truncated_pairs"
    saved_from_it = ("the data state was saved from preference pairs but this run's data "
                     "are not pairs")
    not_saved_from_it = ("the data state was not saved from preference pairs but this run's "
                         "data are pairs")
    rows_per_example = 2   # a chosen and a rejected row

    def __init__(self, config, order):
        self.seq_length, self.order = config.seq_length, order

    def new_counts(self, batch_size):
        return np.zeros(batch_size, np.int64)

    def stream(self, slot, offset):
        return PairStream(self.seq_length, slot)   # offset: always 0, a pair is not split

    def make_batch(self, streams, served, counts, pad_id):
        return make_pair_batch(self.next_rows(streams, served, counts, pad_id))

    def next_rows(self, streams, served, counts, pad_id):
        """The served rows' `PairStream.next_row`s, each row's truncated pairs counted."""
        rows = {r: s.next_row(pad_id) for r, s in streams.items()}
        for r, row in rows.items():
            counts[r] += row[4]   # truncated
        return [rows[r] for r in served]

    def metrics(self, counts, frontier):
        return {"dataset_truncated_pairs": int(counts.sum())}

    def state(self):
        return {"pairs": True}

    def restore(self, state):
        restore_size(self.order, state)


class PairStream:
    """The pairs of one batch row: slots r, r+B, r+2B, ..., one pair per batch. What
    WindowReader feeds (the interface of packing.Stream)."""

    def __init__(self, seq_length, slot):
        self.row_length = seq_length + 1
        self.next_slot = slot
        self.last_usable = slot
        self.ended = None   # only mixtures end streams, and pairs come from no mixture
        self.queue = collections.deque()   # (slot, pair)

    def push_run(self, documents):
        documents = [d for d in documents if d[0] >= self.next_slot]
        if documents:
            self.next_slot = documents[-1][0] + 1
            self.last_usable = documents[-1][0]
            self.queue.extend(documents)

    def skip_to(self, slot):
        self.next_slot = max(self.next_slot, slot)

    def has_row(self):
        return bool(self.queue)

    def is_done(self):
        return not self.queue

    def position(self):
        """(slot, 0): the next row is the pair in `slot`."""
        return (self.queue[0][0] if self.queue else self.next_slot), 0

    def next_row(self, pad_id):
        """(chosen tokens (T+1,), masks, rejected tokens, masks, truncated, and an image
        pair's encodings), padded with pad_id and mask 0; a row of padding only (no pair)
        at the end of a finite pass."""
        if not self.queue:
            empty = np.zeros(0, np.int32), np.zeros(0, np.float32)
            return (*self._pad(*empty, pad_id), *self._pad(*empty, pad_id), False)
        _, (chosen, chosen_masks, rejected, rejected_masks, truncated, *images) = \
            self.queue.popleft()
        return (*self._pad(chosen, chosen_masks, pad_id),
                *self._pad(rejected, rejected_masks, pad_id), truncated, *images)

    def _pad(self, tokens, masks, pad_id):
        need = self.row_length - len(tokens)
        return (np.concatenate([tokens, np.full(need, pad_id, np.int32)]).astype(np.int32),
                np.concatenate([masks, np.zeros(need, np.float32)]).astype(np.float32))


def make_pair_batch(rows):
    """rows: PairStream.next_row results -> chosen_* and rejected_* (b, T) arrays."""
    batch = {}
    for i, side in enumerate(SIDES):
        tokens, masks = np.stack([row[2 * i] for row in rows]), np.stack(
            [row[2 * i + 1] for row in rows])   # (b, T+1)
        batch[f"{side}_input_tokens"] = tokens[:, :-1]
        batch[f"{side}_target_tokens"] = tokens[:, 1:]
        batch[f"{side}_loss_masks"] = masks[:, 1:]
    return batch


def render_pair(render, tokenizer, pair):
    """Preview lines of a pair; render(tokenizer, tokens, masks) marks the no-loss spans."""
    chosen, chosen_masks, rejected, rejected_masks, truncated = pair
    lines = []
    for name, tokens, masks in (("chosen", chosen, chosen_masks),
                                ("rejected", rejected, rejected_masks)):
        lines += [f"{name}: {render(tokenizer, tokens, masks)}",
                  f"({len(tokens)} tokens, {int(masks.sum())} with loss)"]
    if truncated:
        lines.append("(truncated to seq_length)")
    return lines
