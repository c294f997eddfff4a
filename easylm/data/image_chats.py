"""Chats with images, for an image-text model: one chat per row, never packed.

    --family=qwen3_5_vl --load_checkpoint=hf::DIR --tokenizer=DIR
    --train_dataset.text_processor.chat=True --train_dataset.json_dataset.path=chats.jsonl

A row of the data is {"messages": [...]} as for text chats, whose user contents may be
lists of parts: {"type": "text", "text": ...}, {"type": "image", "image": PATH} or
{"type": "image_url", "image_url": {"url": DATA_URL}} (easylm/data/images.py reads them: a
path is relative to the data file's folder, nothing is fetched). The chat template renders
the chat, the model's image processor turns each image into patches and its placeholder
into one token per merged patch (the family's `image_chats` object: for Qwen3.5,
easylm/qwen3_5/images.py); loss masks are text chats' (the assistant's tokens only).

Why not packed: an image's tokens and its patches must stay in one row, and the image
inputs are laid out per row (easylm/models/vision.py); a row holds one chat, padded, and
a chat longer than seq_length + 1 tokens is cut at its end, unless that would cut an
image's tokens (then the row is skipped, with its file and line). A missing or unreadable
image skips its row the same way (with strict=True: stops the run with that line).

A batch holds the text arrays (input_tokens, target_tokens, loss_masks) and the image
inputs of its input_tokens (vision.IMAGE_KEYS), from the family's `batch_inputs`.
Preference pairs of image chats (`ImagePairs`, pairs.py's reader with the family's
`image_chats`) hold each side's: chosen_pixel_values, rejected_image_tokens, ... A token
cache built with --family holds whole image chats and their images' patches
(cache_reader.py); `CachedImageChats` fits them to a run's rows as a json source's are.
"""

import numpy as np

from easylm.data.images import chat_images, data_folder, images_fit
from easylm.data.pairs import SIDES, Pairs, PairStream, make_pair_batch
from easylm.data.rows import restore_size
from easylm.data.text import TextProcessor, _get
from easylm.errors import UserError


def image_chat_problems(config, loader) -> list[str]:
    """Options that cannot meet image chats, as lines (what load_dataset refuses)."""
    problems = []
    if config.type not in ("json", "huggingface", "cache"):
        problems.append(f"--train_dataset.type={config.type}: image chats are read from a "
                        f"json, huggingface or cache source (a mixture holds no images)")
    if loader.segment_ids:
        problems.append("segment_ids=True: image chats are not packed (one chat per row), "
                        "so there are no segments; set it to False")
    return problems


def image_runs(tokens, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of image tokens in `tokens` (one run an image)."""
    edges = np.diff(np.concatenate([[0], (tokens == image_token_id).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


class ImageChatProcessor:
    """Examples -> (tokens (L,), masks (L,), the images' encodings), L <= seq_length + 1;
    or None / a skip reason, as TextProcessor.process. seq_length None: whole chats (what
    a token cache holds)."""

    def __init__(self, text_processor, tokenizer, images, seq_length: int | None):
        self.text = TextProcessor(text_processor, tokenizer)
        self.images = images
        self.row_length = None if seq_length is None else seq_length + 1

    def process(self, examples):
        return [self._one(example, where) if isinstance(example, dict) else example
                for example, where in examples]

    def _one(self, example, where):
        try:
            messages = _get(example, "messages", where, "text_processor.chat=True")
            ids, masks, encoded = self.images.encode_chat(
                self.text, messages, chat_images(messages, where, data_folder(where)), where)
        except UserError as e:
            return str(e)
        return self.fit(ids, masks, encoded, where)

    def fit(self, ids, masks, encoded, where):
        """A whole chat cut to a row, or the reason it cannot be."""
        if self.row_length is None:
            return ids, masks, encoded
        T = self.row_length - 1
        cut = images_fit(ids, self.images.image_token_id, self.row_length, where)
        if cut:
            return cut
        ids, masks = ids[:self.row_length], masks[:self.row_length]
        if not masks[1:].any():
            return f"{where}: no assistant token within seq_length={T}, nothing to train on"
        return ids.astype(np.int32), masks.astype(np.float32), encoded


class CachedImageChats:
    """A token cache of image chats (cache_reader.CacheSource) as a source whose documents
    are fitted to this run's rows (`processor.fit`), as a json source's chats are."""

    def __init__(self, source, processor):
        self.source, self.processor = source, processor

    def __len__(self):
        return len(self.source)

    def read(self, ids):
        records = []
        for i, ((tokens, masks, encoded), _) in zip(np.asarray(ids).tolist(),
                                                    self.source.read(ids)):
            where = f"token cache {self.source.path} document {i}"
            if not len(tokens):   # a row the build skipped (a missing image, ...)
                records.append((f"{where}: skipped when the cache was built", None))
                continue
            chat = self.processor.fit(tokens.astype(np.int32), masks.astype(np.float32),
                                      encoded, where)
            records.append((chat, None))
        return records

    def close(self):
        self.source.close()


class ImageChats:
    """The row kind of image chats (rows.py): one chat per row, never packed, no counters;
    `images` lays out the batch's image inputs."""

    marker, counters = "image_chats", None
    saved_from_it = "the data state was saved from image chats but this run's data are not"
    not_saved_from_it = ("the data state was not saved from image chats but this run's data "
                         "are image chats")
    rows_per_example = 1

    def __init__(self, config, order, images):
        self.seq_length, self.order, self.images = config.seq_length, order, images

    def new_counts(self, batch_size):
        return np.zeros((batch_size, 0, 2), np.int64)

    def stream(self, slot, offset):
        return ImageChatStream(self.seq_length, slot)

    def make_batch(self, streams, served, counts, pad_id):
        rows = {r: s.next_row(pad_id) for r, s in streams.items()}
        tokens = np.stack([rows[r][0] for r in served])   # (b, T+1)
        masks = np.stack([rows[r][1] for r in served])
        T = self.seq_length
        return dict(input_tokens=tokens[:, :-1], target_tokens=tokens[:, 1:],
                    loss_masks=masks[:, 1:],
                    **self.images.batch_inputs(list(tokens[:, :-1]),
                                               [rows[r][2] for r in served], T))

    def metrics(self, counts, frontier):
        return {}

    def state(self):
        return {"image_chats": True}

    def restore(self, state):
        restore_size(self.order, state)


class ImageChatStream(PairStream):
    """The chats of one batch row: slots r, r+B, r+2B, ..., one a batch."""

    def next_row(self, pad_id):
        """(tokens (T+1,), masks, encodings) padded with pad_id and mask 0; a row of
        padding (no image) at the end of a finite pass."""
        if not self.queue:
            return (*self._pad(np.zeros(0, np.int32), np.zeros(0, np.float32), pad_id), [])
        _, (tokens, masks, encoded) = self.queue.popleft()
        return (*self._pad(tokens, masks, pad_id), encoded)


class ImagePairs(Pairs):
    """Preference pairs whose chats hold images (DPO on image prompts): pairs.Pairs' rows
    and, for each side, its rows' image inputs (`chosen_pixel_values`, ...)."""

    def __init__(self, config, order, images):
        super().__init__(config, order)
        self.images = images

    def make_batch(self, streams, served, counts, pad_id):
        rows = self.next_rows(streams, served, counts, pad_id)
        batch = make_pair_batch(rows)
        for i, side in enumerate(SIDES):
            encoded = [row[5 + i] if len(row) > 5 else [] for row in rows]
            inputs = self.images.batch_inputs(list(batch[f"{side}_input_tokens"]), encoded,
                                              self.seq_length)
            batch.update({f"{side}_{key}": value for key, value in inputs.items()})
        return batch
