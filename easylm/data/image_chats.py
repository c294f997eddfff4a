"""Chats with images, for an image-text model: one chat per row, or packed.

    --family=qwen3_5_vl --load_checkpoint=hf::DIR --tokenizer=DIR
    --train_dataset.text_processor.chat=True --train_dataset.json_dataset.path=chats.jsonl
    [--train_dataset.json_dataset.segment_ids=True]   # packed

A row of the data is {"messages": [...]} as for text chats, whose user contents may be
lists of parts: {"type": "text", "text": ...}, {"type": "image", "image": PATH} or
{"type": "image_url", "image_url": {"url": DATA_URL}} (easylm/data/images.py reads them: a
path is relative to the data file's folder, nothing is fetched). The chat template renders
the chat, the model's image processor turns each image into patches and its placeholder
into one token per merged patch (the family's `image_chats` object: for Qwen3.5,
easylm/qwen3_5/images.py); loss masks are text chats' (the assistant's tokens only).

A chat longer than seq_length + 1 tokens is cut at its end, unless that would cut an
image's tokens (then the row is skipped, with its file and line). A missing or unreadable
image skips its row the same way (with strict=True: stops the run with that line).

Rows. Without segment ids a row holds one chat, padded. With segment_ids=True rows are
packed: whole chats one after another while their tokens fit seq_length + 1 and their
patches the model's max_image_patches; the chat that does not fit starts the next row
(so an image's tokens and patches always share a row, and a row's position in the state
is its first chat's slot, offset 0). Each chat is a segment (1, 2, ...; 0 padding) whose
positions restart at 0, its first token never a target; the family's `batch_inputs` lays
out the images of all the row's chats, one after another, and restarts its own positions
per segment (Qwen3.5's multimodal rotary); the model keeps attention, and Gemma 4's
two-way attention among an image's tokens, inside each segment. The shapes are the
unpacked ones (the vision tower always sees (B, max_image_patches) patches): packing
changes no compiled shape, it adds segment_ids and positions to the batch.

A batch holds the text arrays (input_tokens, target_tokens, loss_masks) and the image
inputs of its input_tokens (vision.IMAGE_KEYS), from the family's `batch_inputs`.
Preference pairs of image chats (`ImagePairs`, pairs.py's reader with the family's
`image_chats`) hold each side's: chosen_pixel_values, rejected_image_tokens, ... A token
cache built with --family holds whole image chats and their images' patches
(cache_reader.py); `CachedImageChats` fits them to a run's rows as a json source's are.
"""

import numpy as np

from easylm.data.images import chat_images, data_folder, images_fit
from easylm.data.packing import segment_positions
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

    def fit_document(self, document, where):
        """A token cache's document (cache_reader.CacheSource) fitted as `fit`."""
        tokens, masks, encoded = document
        return self.fit(tokens.astype(np.int32), masks.astype(np.float32), encoded, where)


class CachedImageChats:
    """A token cache of image chats or image pairs (cache_reader.CacheSource) as a source
    whose documents are fitted to this run's rows (`processor.fit_document`: an
    ImageChatProcessor's or a PreferenceProcessor's), as a json source's are."""

    def __init__(self, source, processor):
        self.source, self.processor = source, processor

    def __len__(self):
        return len(self.source)

    def read(self, ids):
        records = []
        for i, (document, _) in zip(np.asarray(ids).tolist(), self.source.read(ids)):
            where = f"token cache {self.source.path} document {i}"
            if not len(document[0]):   # a row the build skipped (a missing image, ...)
                records.append((f"{where}: skipped when the cache was built", None))
                continue
            records.append((self.processor.fit_document(document, where), None))
        return records

    def close(self):
        self.source.close()


class ImageChats:
    """The row kind of image chats (rows.py): one chat per row, or with segment ids whole
    chats packed (the module docstring), no counters; `images` lays out the batch's image
    inputs."""

    marker, counters = "image_chats", None
    saved_from_it = "the data state was saved from image chats but this run's data are not"
    not_saved_from_it = ("the data state was not saved from image chats but this run's data "
                         "are image chats")
    rows_per_example = 1

    def __init__(self, config, order, images):
        self.seq_length, self.order, self.images = config.seq_length, order, images
        self.packed = bool(config.segment_ids)

    def new_counts(self, batch_size):
        return np.zeros((batch_size, 0, 2), np.int64)

    def stream(self, slot, offset):
        if self.packed:
            return PackedImageChatStream(self.seq_length, slot,
                                         self.images.config.max_image_patches)
        return ImageChatStream(self.seq_length, slot)

    def make_batch(self, streams, served, counts, pad_id):
        rows = {r: s.next_row(pad_id) for r, s in streams.items()}
        tokens = np.stack([rows[r][0] for r in served])   # (b, T+1)
        masks = np.stack([rows[r][1] for r in served])
        inputs = list(tokens[:, :-1])
        encoded = [rows[r][2] for r in served]
        T = self.seq_length
        batch = dict(input_tokens=tokens[:, :-1], target_tokens=tokens[:, 1:],
                     loss_masks=masks[:, 1:])
        if not self.packed:
            return dict(batch, **self.images.batch_inputs(inputs, encoded, T))
        segments = np.stack([rows[r][3] for r in served])[:, :-1]
        return dict(batch, segment_ids=segments, positions=segment_positions(segments),
                    **self.images.batch_inputs(inputs, encoded, T, segments))

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


class PackedImageChatStream(PairStream):
    """The chats of one batch row packed: whole chats in slot order while their tokens fit
    a row and their patches `max_patches`; a row is made once the chat after it is known
    (or the pass ended), so its state is its first chat's slot."""

    def __init__(self, seq_length, slot, max_patches: int):
        super().__init__(seq_length, slot)
        self.max_patches = max_patches

    def _fitting(self) -> int:
        """How many of the queue's first chats the next row holds (at least one: a chat
        alone whose patches are too many is refused where the row is laid out)."""
        tokens = patches = 0
        for n, (_, (ids, _, encoded)) in enumerate(self.queue):
            tokens += len(ids)
            patches += sum(len(p) for p, _ in encoded)
            if n and (tokens > self.row_length or patches > self.max_patches):
                return n
        return len(self.queue)

    def has_row(self):
        return self._fitting() < len(self.queue)

    def next_row(self, pad_id):
        """(tokens (T+1,), masks, encodings of the row's images in order, segments (T+1,)):
        each chat's first token has mask 0 (it is the target of the chat before); padding
        is pad_id, mask 0, segment 0."""
        chats = [self.queue.popleft()[1] for _ in range(self._fitting())]
        lengths = [len(ids) for ids, _, _ in chats]
        masks = [m.copy() for _, m, _ in chats]
        for m in masks:
            m[:1] = 0
        tokens, masks = self._pad(np.concatenate([ids for ids, _, _ in chats] or
                                                 [np.zeros(0, np.int32)]),
                                  np.concatenate(masks or [np.zeros(0, np.float32)]), pad_id)
        segments = np.zeros(self.row_length, np.int32)
        segments[:sum(lengths)] = np.repeat(np.arange(1, len(chats) + 1), lengths)
        return tokens, masks, [image for _, _, e in chats for image in e], segments


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
