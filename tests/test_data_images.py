"""easylm/data/images.py: the images a chat names, read from local paths and data URLs, in
order; each bad one is one line naming it and where it was."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from easylm.data.images import chat_images, image_references, read_image
from easylm.errors import UserError


def png(tmp_path, name: str, colour) -> str:
    path = tmp_path / name
    Image.new("RGB", (6, 4), colour).save(path)
    return str(path)


def data_url(colour) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (3, 5), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_images_are_read_in_order_from_paths_and_data_urls(tmp_path):
    png(tmp_path, "red.png", (255, 0, 0))
    messages = [
        {"role": "user", "content": [
            {"type": "image", "image": "red.png"},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": data_url((0, 0, 255))}}]},
        {"role": "assistant", "content": "red, then blue"},
        {"role": "user", "content": [{"type": "image_url", "image_url": data_url((0, 255, 0))}]},
    ]
    images = chat_images(messages, "chats.jsonl line 1", str(tmp_path))
    assert [image.size for image in images] == [(6, 4), (3, 5), (3, 5)]
    assert [tuple(np.asarray(image)[0, 0]) for image in images] == [
        (255, 0, 0), (0, 0, 255), (0, 255, 0)]
    assert image_references([{"role": "user", "content": "no parts"}]) == []


@pytest.mark.parametrize("reference, message", [
    ("missing.png", "chats.jsonl line 7: image {dir}/missing.png: no such file"),
    ("notes.txt", "chats.jsonl line 7: image notes.txt: cannot be read as an image"),
    ("https://example.com/cat.png", "remote URLs are not fetched"),
    ("data:text/plain;base64,aGk=", "a data URL must be data:image/<format>;base64,<data>"),
    ("data:image/png;base64,@@@", "its base64 data does not decode"),
    ("data:image/png;base64,aGk=", "cannot be read as an image"),
])
def test_a_bad_image_is_one_line_naming_it_and_its_row(tmp_path, reference, message):
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(UserError) as error:
        read_image(reference, "chats.jsonl line 7", str(tmp_path))
    text = str(error.value)
    assert "\n" not in text and text.startswith("chats.jsonl line 7: image ")
    assert message.format(dir=tmp_path) in text


def test_an_image_part_without_a_reference_is_named():
    with pytest.raises(UserError, match="an image part needs a path or a data URL"):
        image_references([{"role": "user", "content": [{"type": "image"}]}])
