"""Prompts for online RL (`--objective=grpo`): one prompt per row, never packed.

    --objective=grpo --train_dataset.json_dataset.path=math.jsonl

An example holds `prompt`: text (tokenized as the text processor does a document's first
field: BOS per add_bos_token, prepend_text, no EOS), or chat messages; or `messages`
(chat). Messages are rendered with the tokenizer's chat template (or
text_processor.chat_template) with the generation prompt added, as TRL renders
conversational prompts. Every other field (`answer`, ...) travels with the prompt to the
reward functions.

Row r takes the prompts of slots r, r+B, r+2B, ... one per batch, as preference pairs do
(pairs.PairStream: the same state, shares and shuffling). A prompt longer than
`max_prompt_tokens` (the row less the completion's room) is skipped, counted and warned
about with its file and line, or with strict=True stops the run with that line. Rows of
seq_length tokens hold prompt + completion (the engine's context is seq_length).

A batch (host arrays, not for the devices as they are): prompt_tokens (b, P) padded,
prompt_lengths (b,) (0: a padding row at the end of an eval pass), and the examples
(b,) as an object array of dicts, the prompt's own value under `prompt`. For an
image-text model (`images`, with text_processor.chat=True) a chat prompt may hold image
parts (easylm/data/images.py; paths relative to the data file): each image's placeholder
is expanded to its tokens and the batch adds image_encodings (b,), each row's images'
encodings (the family's `encode_prompt`), which the rollouts prefill.
"""

import os

import numpy as np

from easylm.data.images import chat_images, data_folder
from easylm.data.pairs import PairStream
from easylm.data.rows import restore_size
from easylm.data.sources import open_source
from easylm.data.text import TextProcessor, _add_bos, is_messages
from easylm.errors import UserError


def chat_template(template: str, tokenizer) -> str | None:
    """text_processor.chat_template (a Jinja template or a file holding one), or the
    tokenizer's."""
    if template and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    return template or tokenizer.chat_template


class PromptProcessor:
    """Examples -> (prompt tokens (L,) int32, the example) or a skip reason."""

    def __init__(self, text_processor, tokenizer, max_prompt_tokens: int, images=None):
        """images: an image-text model's `image_chats` object: a chat prompt may then hold
        image parts, and a prompt is (tokens, example, its images' encodings)."""
        self.text = TextProcessor(text_processor, tokenizer)
        self.images = images
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        c = self.text.config
        self._bos = tokenizer.bos_token_id if _add_bos(c.add_bos_token, tokenizer) else None
        self._prepend = c.prepend_text
        self._template = chat_template(c.chat_template, tokenizer)

    def process(self, examples):
        return [self._one(example, where) if isinstance(example, dict) else example
                for example, where in examples]

    def _one(self, example, where):
        value = example.get("prompt", example.get("messages"))
        if value is None:
            return (f"{where}: missing field 'prompt' (text or chat messages) or 'messages'; "
                    f"the example has: {', '.join(map(str, example)) or 'no fields'}")
        if isinstance(value, str):
            ids = self.tokenizer(self._prepend + value, add_special_tokens=False)["input_ids"]
            ids = ([self._bos] if self._bos is not None else []) + list(ids)
        elif is_messages(value, self.images is not None) and value:
            if not self._template:
                raise UserError("a prompt holds chat messages but the tokenizer has no chat "
                                "template; set --train_dataset.text_processor.chat_template")
            text = self.tokenizer.apply_chat_template(value, chat_template=self._template,
                                                      tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.images is not None:
                try:
                    ids, encoded = self.images.encode_prompt(
                        ids, chat_images(value, where, data_folder(where)), where)
                except UserError as e:
                    return str(e)
        else:
            return (f"{where}: field 'prompt' must be text or a non-empty list of "
                    f"{{\"role\": str, \"content\": str}} objects")
        if not len(ids):
            return f"{where}: empty prompt"
        if len(ids) > self.max_prompt_tokens:
            return (f"{where}: the prompt is {len(ids)} tokens, longer than the "
                    f"{self.max_prompt_tokens} a row leaves it (seq_length - "
                    f"--grpo.max_new_tokens)")
        if self.images is not None:
            return np.asarray(ids, np.int32), dict(example, prompt=value), encoded
        return np.asarray(ids, np.int32), dict(example, prompt=value)


class Prompts:
    """The row kind of prompts (rows.py): one prompt per row, no counters."""

    marker, counters = "prompts", None
    saved_from_it = "the data state was saved from prompts but this run's data are not prompts"
    not_saved_from_it = ("the data state was not saved from prompts but this run's data are "
                         "prompts")
    rows_per_example = 1

    def __init__(self, config, order):
        self.seq_length, self.order = config.seq_length, order

    def new_counts(self, batch_size):
        return np.zeros((batch_size, 0), np.int64)

    def stream(self, slot, offset):
        return PromptStream(self.seq_length, slot)

    def make_batch(self, streams, served, counts, pad_id):
        rows = [streams[r].next_prompt() for r in served]
        longest = max([len(row[0]) for row in rows] + [1])
        tokens = np.full((len(rows), longest), pad_id, np.int32)
        for i, (ids, *_) in enumerate(rows):
            tokens[i, :len(ids)] = ids
        examples = np.empty(len(rows), object)
        examples[:] = [row[1] for row in rows]
        batch = {"prompt_tokens": tokens,
                 "prompt_lengths": np.asarray([len(row[0]) for row in rows], np.int32),
                 "examples": examples}
        if any(len(row) > 2 for row in rows):   # image prompts: their images' encodings
            batch["image_encodings"] = np.empty(len(rows), object)
            batch["image_encodings"][:] = [row[2] if len(row) > 2 else [] for row in rows]
        return batch

    def metrics(self, counts, frontier):
        return {}

    def state(self):
        return {"prompts": True}

    def restore(self, state):
        restore_size(self.order, state)


class PromptStream(PairStream):
    """The prompts of one batch row (slots r, r+B, ...), one per batch."""

    def next_prompt(self):
        """(tokens, example); (no tokens, None) past the end of a finite pass."""
        if not self.queue:
            return np.zeros(0, np.int32), None
        return self.queue.popleft()[1]


def open_prompts(config, loader, tokenizer, completion_tokens: int, images=None):
    """(source, PromptProcessor) for a json or huggingface block of options, whose
    prompts leave `completion_tokens` of a row for the completion; `images`: an
    image-text model's reader of image parts."""
    max_prompt_tokens = loader.seq_length - completion_tokens
    if config.type not in ("json", "huggingface"):
        raise UserError(f"--objective=grpo reads prompts from a json or huggingface source, "
                        f"not --train_dataset.type={config.type}")
    if max_prompt_tokens < 1:
        raise UserError(f"--grpo.max_new_tokens={completion_tokens} leaves no room for a "
                        f"prompt in rows of seq_length={loader.seq_length} tokens")
    source, _ = open_source(config.type, loader, config.text_processor, tokenizer,
                            loader.strict)
    return source, PromptProcessor(config.text_processor, tokenizer, max_prompt_tokens, images)
