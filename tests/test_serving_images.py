"""Images in chat requests (`/v1/chat/completions` with OpenAI's image parts) for both
image-text families, served by `python -m easylm.serve`'s app (`cli.build` from its flags,
`--load_checkpoint=hf::DIR`) through FastAPI's TestClient: 8 greedy tokens of a chat with
a data-URL image = transformers' `generate` on the same chat (the tokenizer's chat
template, the checkpoint's image processor), and another image changes them (the negative
twin). The checkpoints are tests/test_vision_qwen3_5.py's and test_vision_gemma4.py's tiny
random models, saved by transformers 5.25 here with their PIL image processors.

Qwen3.5's decode continues at its multimodal rotary's positions (the image takes fewer
positions than tokens: `rope_delta` in the cache), so 8 equal tokens after an image
check the decode continuation too. Greedy tokens are compared as ids (their texts): equal
argmaxes, no tolerance; the random weights keep the top two logits apart by far more
than fp32's drift (the parity tests' REL).
"""

import base64
import io
import re
import types

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

import test_vision_gemma4 as gemma_test
import test_vision_qwen3_5 as qwen_test
from easylm.gemma4.vision_hf import FAMILY as GEMMA4_VL
from easylm.models.vision import load_image_processor
from easylm.qwen3_5.vision_hf import FAMILY as QWEN35_VL
from easylm.serving import cli, server as server_lib
from easylm.serving.batcher import Batcher
from easylm.serving.engine import PromptImages, Sampling

# Gemma 4's chat template in small: an image part is <|image|> (its processor writes it
# out as <boi>, one <|image|> per soft token, <eoi>).
GEMMA_TEMPLATE = (
    "{% for m in messages %}<|turn>{{ m['role'] }} {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
    "{{ p['text'] }} {% else %}<|image|> {% endif %}{% endfor %}{% endif %}<turn|> "
    "{% endfor %}{% if add_generation_prompt %}<|turn>model {% endif %}")


def gemma_tokenizer(config):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<|image|>": config.image_token_id, "<boi>": config.boi_token_id,
                "<eoi>": config.eoi_token_id, "<|turn>": 503, "<turn|>": 504}
    vocab = {f"w{i}": i for i in range(500)} | specials | {"user": 505, "model": 506}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w0")
    fast.chat_template = GEMMA_TEMPLATE
    return fast


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(url: str, text: str = "w40 w41") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


class Qwen:
    # seq_length: one length bucket and one decode window (one program each): the chat
    # (6 image tokens) is 15 tokens, 8 more and a decode call past the end fit 64.
    family, test, size, seq = QWEN35_VL, qwen_test, (24, 16), 64
    features = ("pixel_values", "image_grid_thw")  # what its generate reads
    tokenizer = staticmethod(qwen_test.vl_tokenizer)

    @staticmethod
    def processor():
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                        size={"shortest_edge": 64, "longest_edge": 1024})

    @staticmethod
    def expand(text, features, config):
        """<|image_pad|> repeated per merged patch, as Qwen3_5Processor writes it."""
        n = int(features["image_grid_thw"].prod()) // config.vision_spatial_merge_size ** 2
        return text.replace("<|image_pad|>", " ".join(["<|image_pad|>"] * n))


class Gemma:
    # The chat (60 image tokens, <boi> and <eoi>) is 69 tokens. Its processor resizes
    # any image to at most 70 soft tokens, which fit: no image is too large.
    family, test, size, seq = GEMMA4_VL, gemma_test, (16, 24), 128
    features = ("pixel_values", "image_position_ids")
    tokenizer = staticmethod(gemma_tokenizer)

    @staticmethod
    def processor():
        from transformers import Gemma4ImageProcessorPil

        return Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2)

    @staticmethod
    def expand(text, features, config):
        """The image as Gemma4Processor.replace_image_token writes it."""
        from transformers import Gemma4Processor

        names = types.SimpleNamespace(boi_token="<boi>", eoi_token="<eoi>",
                                      image_token="<|image|>")
        return text.replace("<|image|>", Gemma4Processor.replace_image_token(
            names, features, 0).replace("><", "> <"))


def generate_inputs(kind, directory, tokenizer, config, image) -> dict:
    """transformers' generate inputs: the chat template's text, the image's placeholder
    expanded as the family's processor writes it, the image processor's features."""
    features = load_image_processor(directory)(images=[image], return_tensors="pt")
    text = tokenizer.apply_chat_template(user("x"), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(kind.expand(text, features, config), add_special_tokens=False,
                    return_tensors="pt").input_ids
    return dict(input_ids=ids, **{key: features[key] for key in kind.features},
                mm_token_type_ids=(ids == config.image_token_id).int())


# Gemma 4's (about a minute on two cores) is before a release: CI's Qwen3.5 covers the
# engine's image path, its rotary continuation included.
@pytest.fixture(scope="module", params=[Qwen, pytest.param(Gemma, marks=pytest.mark.extended)],
                ids=["qwen3_5_vl", "gemma4_vl"])
def served(request, tmp_path_factory):
    """(kind, TestClient of the served app, transformers' model, tokenizer, hf dir,
    the Service)."""
    kind = request.param
    directory = tmp_path_factory.mktemp(kind.family.name)
    config = kind.family.from_preset("debug")
    model, tokenizer = kind.test.torch_model(config), kind.tokenizer(config)
    model.save_pretrained(directory / "hf")
    kind.processor().save_pretrained(directory / "hf")
    tokenizer.save_pretrained(directory / "tokenizer")  # apart: see test_image_chats.py
    flags = cli.parse_flags(kind.family, [
        "serve", f"--load_checkpoint=hf::{directory / 'hf'}",
        f"--tokenizer={directory / 'tokenizer'}", f"--seq_length={kind.seq}",
        f"--min_bucket={kind.seq}", "--batch_size=2", "--max_tokens=8", "--page_size=16"])
    # cli.build's pieces, the service kept for the sharing check.
    engine, tokenizer, stop_ids = cli.load_engine(kind.family, flags)
    batcher = Batcher(engine, stop_ids).start()
    service = server_lib.Service(flags, batcher, tokenizer,
                                 *cli.image_reader(kind.family, flags))
    with TestClient(server_lib.create_app(service), base_url="http://127.0.0.1") as client:
        yield kind, client, model, tokenizer, str(directory / "hf"), service
    batcher.stop()


def chat(client, messages, **fields):
    return client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, **fields})


def served_tokens(client, image) -> list[str]:
    response = chat(client, user(data_url(image)))
    assert response.status_code == 200, response.text
    return [entry["token"] for entry in response.json()["choices"][0]["logprobs"]["content"]]


def generated(served, image) -> list[str]:
    """transformers' 8 greedy tokens (to its first end of sequence, which ours stops at)."""
    kind, _, model, tokenizer, directory, _ = served
    config = kind.family.hf.read_config(directory)
    inputs = generate_inputs(kind, directory, tokenizer, config, image)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    stops = {tokenizer.eos_token_id, config.eos_token_id}
    ended = next((i for i, t in enumerate(new) if t in stops), len(new))
    return [tokenizer.decode([t]) for t in new[:ended]]


def test_greedy_tokens_of_an_image_chat_equal_transformers_generate(served):
    kind = served[0]
    image, other = (kind.test.picture(seed, *kind.size) for seed in (0, 9))
    ours = served_tokens(served[1], image)
    assert ours == generated(served, image) and len(ours) >= 4
    # The negative twin: another image, other tokens (and transformers' own).
    twin = served_tokens(served[1], other)
    assert twin != ours and twin == generated(served, other)

    # Both prompts in one prefill call: the same token ids, never shared (each its own
    # image's first token; shared by ids, both would take the first's).
    service = served[5]
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w40 w41"}]}]
    (ids, first), (same, second) = (service.chat_prompt(parts, [data_url(x)])
                                    for x in (image, other))
    assert ids == same
    engine = service.batcher.engine
    tokens = service.batcher.run(lambda: engine.fetch(engine.prefill(
        [ids, same], [0, 1], Sampling.empty(2),
        images=PromptImages.each([first, second])))[0]).result()
    assert [service.tokenizer.decode([t]) for t in tokens[0]] == [ours[0], twin[0]]


def test_bad_images_are_json_4xx_and_the_server_keeps_serving(served):
    """Each a 400 naming its problem, in one line; then a good request still answers."""
    kind, client = served[:2]
    cases = [
            ("https://example.com/cat.png", "remote URLs are not fetched"),
            ("data:image/png;base64,@@@@", "does not decode"),
            ("data:image/png;base64," + base64.b64encode(b"not a png").decode(),
             "cannot be read as an image"),
            ("data:text/plain;base64,aGk=", "data:image/<format>;base64")]
    # Images too many for the context (each resized to the processor's largest: Qwen's
    # 16 tokens, Gemma's 70).
    big = {"type": "image_url", "image_url": {"url": data_url(kind.test.picture(0, 64, 64))}}
    too_many = [{"role": "user", "content": [big] * 4}]
    for messages, message in [(user(url), message) for url, message in cases] + [
            (too_many, rf"of them its 4 image\(s\)'; the context is {kind.seq} tokens")]:
        response = chat(client, messages)
        error = response.json()["error"]["message"]
        assert response.status_code == 400 and "\n" not in error, error
        assert re.search(message, error), error
    response = chat(client, [{"role": "user", "content": [{"type": "image_url"}]}])
    assert response.status_code == 400
    assert served_tokens(client, kind.test.picture(0, *kind.size))
