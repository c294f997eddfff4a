"""The images a chat names, read: the parts of a message's content that are images,

    {"type": "image", "image": PATH_OR_DATA_URL}
    {"type": "image_url", "image_url": {"url": PATH_OR_DATA_URL}}   (OpenAI's; or a string)

as RGB PIL images, in the order they appear. A path is a local file (relative to
`base_dir`, the data file's folder); a data URL is `data:image/...;base64,...`. Nothing is
fetched: an http(s) URL is refused. A missing or unreadable image is one line naming it
and where it was (the data file and row, or the request).
"""

import base64
import binascii
import io
import json
import os

import numpy as np

from easylm.errors import UserError


def image_reference(part) -> str | None:
    """The path or URL an image part names; None for a part that is no image."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image" or (kind is None and "image" in part):
        reference = part.get("image")
    elif kind == "image_url" or (kind is None and "image_url" in part):
        reference = part.get("image_url")
        reference = reference.get("url") if isinstance(reference, dict) else reference
    else:
        return None
    if not isinstance(reference, str) or not reference:
        raise UserError(f"an image part needs a path or a data URL, got {part!r}")
    return reference


def image_references(messages) -> list[str]:
    """Every image part's path or URL, message by message, part by part."""
    references = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            references += [r for r in map(image_reference, content) if r is not None]
    return references


def read_image(reference: str, where: str, base_dir: str = ""):
    """The RGB image `reference` (a local path or a data URL) names; `where` says whose
    it is in the one-line error (e.g. 'chats.jsonl line 3')."""
    from PIL import Image, UnidentifiedImageError

    shown = reference if len(reference) <= 80 else reference[:60] + "..."
    if reference.startswith(("http://", "https://")):
        raise UserError(f"{where}: image {shown}: remote URLs are not fetched; give a local "
                        f"path or a data URL (data:image/png;base64,...)")
    if reference.startswith("data:"):
        header, _, payload = reference.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64"):
            raise UserError(f"{where}: image {shown}: a data URL must be "
                            f"data:image/<format>;base64,<data>")
        try:
            source = io.BytesIO(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise UserError(f"{where}: image {shown}: its base64 data does not decode") from None
    else:
        source = os.path.join(base_dir, reference)
        if not os.path.isfile(source):
            raise UserError(f"{where}: image {source}: no such file")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{where}: image {shown}: cannot be read as an image "
                        f"({str(e).splitlines()[0]})") from None


def chat_images(messages, where: str, base_dir: str = "") -> list:
    """The images `messages` name, read, in order."""
    return [read_image(reference, where, base_dir) for reference in image_references(messages)]


def data_folder(where: str) -> str:
    """The folder of the data file `where` ('path:line') names: image paths are relative
    to it ('' for a row of a huggingface dataset: the working directory)."""
    path, sep, line = where.rpartition(":")
    return os.path.dirname(path) if sep and line.isdigit() else ""


def images_fit(ids, image_token_id: int, row_length: int, where: str) -> str | None:
    """Why a row of `ids` cannot be cut to `row_length` tokens (its image tokens reach
    past it), or None."""
    places = np.flatnonzero(ids == image_token_id)
    if len(places) and places[-1] >= row_length - 1:
        return (f"{where}: its image tokens reach token {places[-1] + 1}, past "
                f"seq_length={row_length - 1}: the chat cannot be cut without cutting an image")
    return None


def first_rows_problems(path: str, rows: int) -> list[str]:
    """One line per image of the first `rows` chats of the JSONL file `path` that cannot
    be read (missing, unreadable, remote), naming the file and row as the data pipeline
    does ('path:line'): what `python -m easylm.doctor` checks before a run."""
    problems = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if line > rows:
                break
            where = f"{path}:{line}"
            try:
                messages = json.loads(text).get("messages") or []
                for reference in image_references(messages):
                    read_image(reference, where, os.path.dirname(path))
            except UserError as e:
                problems.append(str(e))
            except (ValueError, AttributeError):
                problems.append(f"{where}: not a JSON object with messages")
    return problems


def image_chat_reader(family: str, load_checkpoint: str, tokenizer: str):
    """The reader of image chats (models/vision.py's ImageChatReader) of the image-text
    model --family and --load_checkpoint=hf::DIR name, or None without --family (what
    `preview` and the token cache take)."""
    if not family:
        return None
    # Only here: the families (and JAX) load when an image-text model is asked for.
    from easylm.models import registry
    from easylm.models.family import hf_adapter
    from easylm.models.vision import processor_directory

    model_family = registry.get(family)
    if not load_checkpoint.startswith("hf::"):
        raise UserError(f"--family={family}: give the model as --load_checkpoint=hf::DIR "
                        f"(its config.json and image processor)")
    model = hf_adapter(model_family).read_config(load_checkpoint[len("hf::"):])
    images = model_family.image_chats(model, processor_directory(tokenizer, load_checkpoint))
    if images is None:
        raise UserError(f"--family={family} reads no images")
    return images
