"""Turn examples (dicts of text) into tokens and loss masks, EasyLM's way.

`fields` is a comma-separated list of spans, written in order:
  `a+b`      the fields a and b joined by `subfield_separator`, tokenized together;
  `[...]`    any span in brackets gets no loss (mask 0), e.g. `[instruction+input],output`;
  `<|bos|>`, `<|eos|>`, `<|123|>`  one special token (BOS, EOS, or that id).
`add_bos_token` puts BOS (mask 0) first: `auto` (the default) when the tokenizer does so
itself (`tokenizer(text)`: LLaMA's do, SmolLM2's ByteLevel BPE does not), `true` always,
`false` never. `add_eos_token` puts EOS (mask 1) last, so the model learns where an answer
stops. `fields_from_example=key` reads the spec from each
example's `key` instead. In `chat` mode an example's OpenAI-style `messages` are rendered
with the tokenizer's chat template (or `chat_template`) and only assistant turns get loss;
the template, not add_bos_token/add_eos_token, decides the special tokens.

A mask value belongs to its token: 1 means "predicting this token is trained on".
Examples are tokenized in batches (`process`) because one Rust call per batch is what
makes the pipeline as fast as raw `tokenizers`.
"""

import functools
import json
import os

import numpy as np
from ml_collections import ConfigDict

from easylm.data.images import image_references
from easylm.errors import UserError


def _add_bos(flag, tokenizer) -> bool:
    """--text_processor.add_bos_token as a bool: `auto` is whether the tokenizer puts its
    BOS first by itself (as the server's --add_bos_token=auto encodes prompts)."""
    value = str(flag).lower()
    if value not in ("auto", "true", "false"):
        raise UserError(f"text_processor.add_bos_token must be auto, true or false, got "
                        f"{flag!r}")
    if value != "auto":
        return value == "true"
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


class TextProcessor:

    HELP = {
        "fields": "comma-separated fields making a document: a+b joins fields, [..] = no "
                  "loss, <|bos|> <|eos|> <|id|> put one token; e.g. [instruction+input],output",
        "fields_from_example": "read the fields spec from this field of each example",
        "subfield_separator": "text between the fields joined by + in fields",
        "add_bos_token": "start each document with BOS (no loss): auto (as tokenizer(text) "
                         "does, the server's default too), true or false",
        "add_eos_token": "end each document with EOS (with loss)",
        "prepend_text": "text put before the first text field",
        "chat": "examples hold OpenAI-style messages; only assistant turns get loss",
        "chat_template": "Jinja chat template (or a file holding one); '' = the tokenizer's",
    }

    @staticmethod
    def get_default_config(updates=None):
        config = ConfigDict()
        config.fields = "text"
        config.fields_from_example = ""
        config.subfield_separator = " "
        config.add_bos_token = "auto"
        config.add_eos_token = True
        config.prepend_text = ""
        config.chat = False
        config.chat_template = ""
        if updates is not None:
            updates = ConfigDict(updates).copy_and_resolve_references().to_dict()
            if isinstance(updates.get("add_bos_token"), bool):  # it was a bool until 'auto'
                updates["add_bos_token"] = str(updates["add_bos_token"]).lower()
            config.update(updates)
        return config

    def __init__(self, config, tokenizer):
        self.config = self.get_default_config(config)
        self.tokenizer = tokenizer
        c = self.config
        if not c.chat and not c.fields and not c.fields_from_example:
            raise UserError("text_processor.fields and text_processor.fields_from_example "
                            "are both empty; say which fields hold the text")
        self._vocab_size = len(tokenizer)
        if c.fields and not c.fields_from_example and not c.chat:
            # Fail now on a bad spec, not at the first example.
            for _, special, _ in parse_fields(c.fields):
                if special is not None:
                    self._special_id(special)
        add_bos = _add_bos(c.add_bos_token, tokenizer)
        for flag, token, wanted in (("add_bos_token", "bos", add_bos),
                                    ("add_eos_token", "eos", c.add_eos_token)):
            if wanted and not c.chat and getattr(tokenizer, f"{token}_token_id") is None:
                raise UserError(f"text_processor.{flag}=True but the tokenizer has no "
                                f"{token.upper()} token; set text_processor.{flag}=False")
        # Plain attributes: a ConfigDict or tokenizer lookup per document is measurable.
        self._bos = tokenizer.bos_token_id if add_bos else None
        self._eos = tokenizer.eos_token_id if c.add_eos_token else None
        self._fields = "" if c.fields_from_example else c.fields
        self._prepend, self._separator = c.prepend_text, c.subfield_separator
        self.chat_template = None
        if c.chat:
            template = c.chat_template
            if template and os.path.isfile(template):
                with open(template, encoding="utf-8") as f:
                    template = f.read()
            self.chat_template = template or tokenizer.chat_template
            if not self.chat_template:
                raise UserError("text_processor.chat=True but the tokenizer has no chat "
                                "template; set text_processor.chat_template")

    def process(self, examples):
        """examples: list of (example, where); example is a dict, or None (blank line) or
        a str (an error message from the reader), which pass through unchanged.
        Returns one entry per example: (tokens int32 (L,), masks float32 (L,)), None,
        or a str saying why the example is skipped."""
        if self.config.chat:
            return self._process_chat(examples)
        return self._process_fields(examples)

    def _process_fields(self, examples):
        plans, texts = [], []
        for example, where in examples:
            if not isinstance(example, dict):
                plans.append(example)
                continue
            spec = self._fields or _text(example, self.config.fields_from_example, where,
                                         "text_processor.fields_from_example")
            plan = []
            for i, (names, special, mask) in enumerate(parse_fields(spec)):
                if special is not None:
                    plan.append(([self._special_id(special)], mask))
                    continue
                text = self._separator.join(
                    _text(example, name, where, f"fields={spec!r}") for name in names)
                if i == 0:
                    text = self._prepend + text
                plan.append((len(texts), mask))
                texts.append(text)
            plans.append((plan, where))
        encodings = self.tokenizer.backend_tokenizer.encode_batch_fast(
            texts, add_special_tokens=False)
        return [self._assemble(plan, encodings) for plan in plans]

    def _assemble(self, plan, encodings):
        if not isinstance(plan, tuple):
            return plan
        plan, where = plan
        pieces = [(piece if isinstance(piece, list) else encodings[piece].ids, mask)
                  for piece, mask in plan]
        if not any(len(ids) for (ids, _), (piece, _) in zip(pieces, plan)
                   if isinstance(piece, int)):
            return f"{where}: empty text"
        if self._bos is not None:
            pieces.insert(0, ([self._bos], 0.0))
        if self._eos is not None:
            pieces.append(([self._eos], 1.0))
        lengths = [len(ids) for ids, _ in pieces]
        tokens = np.empty(sum(lengths), np.int32)
        start = 0
        for (ids, _), n in zip(pieces, lengths):
            tokens[start:start + n] = ids
            start += n
        masks = np.repeat(np.asarray([m for _, m in pieces], np.float32), lengths)
        return tokens, masks

    def _special_id(self, name):
        token_id = {"bos": self.tokenizer.bos_token_id,
                    "eos": self.tokenizer.eos_token_id}.get(name, None)
        if token_id is None:
            if not name.isdigit():
                raise UserError(f"<|{name}|> in text_processor.fields: the tokenizer has no "
                                f"such token; use <|bos|>, <|eos|> or a token id like <|2|>")
            token_id = int(name)
            if token_id >= self._vocab_size:
                raise UserError(f"<|{name}|> in text_processor.fields: token id {token_id} is "
                                f"outside the tokenizer's {self._vocab_size} tokens (ids 0 to "
                                f"{self._vocab_size - 1})")
        return token_id

    def _process_chat(self, examples):
        return self.encode_chats([
            (_get(example, "messages", where, "text_processor.chat=True"), 0, where)
            if isinstance(example, dict) else example for example, where in examples])

    def encode_chats(self, chats, parts: bool = False):
        """chats: (messages, first, where) each, or a value passed through as in `process`.
        Only assistant messages from index `first` on get loss (preference pairs train
        only the replies after their shared conversation). `parts`: a message's content
        may be a list of parts (an image-text model's chats, easylm/data/images.py)."""
        rendered = [(*self._render(chat[0], chat[2], chat[1], parts), chat[2])
                    if isinstance(chat, tuple) else chat for chat in chats]
        texts = [r[0] for r in rendered if isinstance(r, tuple)]
        encodings = iter(self.tokenizer.backend_tokenizer.encode_batch(
            texts, add_special_tokens=False))
        results = []
        for r in rendered:
            if not isinstance(r, tuple):
                results.append(r)
                continue
            _, spans, where = r
            encoding = next(encodings)
            if not spans:
                results.append(f"{where}: no assistant message, so nothing to train on")
                continue
            starts = np.asarray([start for start, _ in encoding.offsets], np.int64)
            masks = np.zeros(len(starts), np.float32)
            for begin, end in spans:
                masks[(starts >= begin) & (starts < end)] = 1.0
            results.append((np.asarray(encoding.ids, np.int32), masks))
        return results

    def _render(self, messages, where, first=0, parts=False):
        """The conversation as text and the (begin, end) characters of each assistant turn
        from message `first` on. A turn spans from the end of the prompt that asks for it
        to the end of the turn."""
        if not parts and is_messages(messages, True) and _has_images(messages):
            raise UserError(f"{where}: a message has image parts, which only an image-text "
                            f"model reads, from a json or huggingface source (e.g. "
                            f"--family=qwen3_5_vl, docs/vision.md); a token cache holds "
                            f"them when built with that --family")
        if not is_messages(messages, parts):
            raise UserError(f"{where}: 'messages' must be a list of "
                            f"{{\"role\": str, \"content\": str"
                            f"{' or a list of parts' if parts else ''}}} objects")
        render = functools.partial(self.tokenizer.apply_chat_template,
                                   chat_template=self.chat_template, tokenize=False)
        text = render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < first:
                continue
            prompt = render(messages[:i], add_generation_prompt=True) if i else ""
            turn = render(messages[:i + 1])
            if not (text.startswith(turn) and turn.startswith(prompt)):
                raise UserError(f"{where}: the chat template renders a conversation's start "
                                f"differently from the whole conversation, so assistant "
                                f"turns cannot be located")
            spans.append((len(prompt), len(turn)))
        return text, spans


def is_messages(value, parts: bool = False):
    """Whether `value` is a list of {"role": str, "content": str} objects (with `parts`,
    a content may also be a list of {"type": ...} parts)."""
    def content(c):
        return isinstance(c, str) or (parts and isinstance(c, list) and all(
            isinstance(p, dict) for p in c))
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and content(m.get("content"))
        for m in value)


def _has_images(messages) -> bool:
    try:
        return bool(image_references(messages))
    except UserError:  # an image part without a path: an image part all the same
        return True


@functools.lru_cache(maxsize=256)
def parse_fields(spec):
    """'[a+b],<|eos|>,c' -> ((('a','b'), None, 0.0), ((), 'eos', 1.0), (('c',), None, 1.0))."""
    parsed = []
    for position, field in enumerate(spec.split(","), 1):
        mask = 1.0
        if field.startswith("[") and field.endswith("]"):
            field, mask = field[1:-1], 0.0
        if field.startswith("<|") and field.endswith("|>") and len(field) > 4:
            parsed.append(((), field[2:-2], mask))
            continue
        names = tuple(field.split("+"))
        if not all(names):
            raise UserError(f"text_processor.fields={spec!r}: field {position} ({field!r}) "
                            f"has an empty name")
        parsed.append((names, None, mask))
    return tuple(parsed)


def _get(example, name, where, context):
    if name not in example:
        raise UserError(f"{where}: missing field {name!r} ({context}); the example has: "
                        f"{', '.join(map(str, example)) or 'no fields'}")
    return example[name]


def _text(example, name, where, context):
    value = _get(example, name, where, context)
    if not isinstance(value, str):
        raise UserError(f"{where}: field {name!r} is {type(value).__name__}, expected text")
    return value


def parse_json_line(line, where):
    """One JSON-lines record -> dict, None for a blank line, or a str saying what is wrong."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{where}: not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
    if not text.strip():
        return None
    try:
        example = json.loads(text)
    except json.JSONDecodeError as e:
        return f"{where}: malformed JSON ({e.msg} at column {e.colno})"
    if not isinstance(example, dict):
        return f"{where}: expected a JSON object, got {type(example).__name__}"
    return example
