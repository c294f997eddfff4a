"""What the API routes share: the server's settings, the `Service` (tokenizer, batcher,
limits, async helpers), request errors and text checks. openai_api.py, easylm_api.py
and server.py import it; it imports none of them."""

import asyncio
import dataclasses
import json
from typing import Annotated, Sequence

from fastapi import Request
from ml_collections import ConfigDict
from pydantic import AfterValidator, StrictStr

from easylm.errors import UserError
from easylm.serving.batcher import Batcher, Generation, SamplingParams
from easylm.serving.scoring import Job

MAX_STOPS = 16  # stop strings per prompt (OpenAI allows 4; lm-eval sends a few)

HELP = {
    "host": "address to bind; 127.0.0.1 serves this machine only, 0.0.0.0 every interface",
    "port": "TCP port (0: any free one; the ready line names it)",
    "api_key": "if set, every API request needs the header `Authorization: Bearer KEY`",
    "model_name": "the model id in /v1/models; requests naming another model get a 404",
    "max_request_bytes": "largest request body accepted (413 above)",
    "max_prompts": "most prompts (or texts) in one request, n samples of a prompt "
                   "counting n (400 above)",
    "max_tokens": "largest max_tokens a request may ask for; also the default for chat",
    "read_timeout": "seconds a client has to send a whole request (line, headers, body) "
                    "from its first byte, or from connecting; then 408 and the "
                    "connection closes",
    "keep_alive_timeout": "seconds an idle kept-alive connection stays open between requests",
    "max_connections": "open connections at most; more are answered 503 and closed",
    "max_header_bytes": "largest request line plus headers (431 above)",
    "allowed_hosts": "comma-separated Host names accepted besides loopback ones when "
                     "bound to a loopback address ('*': any); when bound to another "
                     "address and set, only these and loopback names",
    "chat_template": "Jinja chat template (a file path or the template itself); "
                     "empty: the tokenizer's own",
    "add_bos_token": "text prompts: auto tokenizes them as the tokenizer does by itself "
                     "(HF's add_special_tokens=True); true puts BOS first (EOS if the "
                     "tokenizer has none), false adds no special token. Chat templates "
                     "and token-id prompts are never changed",
    "chat_prepend_text": "EasyLM /chat: text before the whole conversation",
    "chat_user_prefix": "EasyLM /chat: text before each user message",
    "chat_user_suffix": "EasyLM /chat: text after each user message",
    "chat_lm_prefix": "EasyLM /chat: text before each model reply",
    "chat_lm_suffix": "EasyLM /chat: text after each model reply",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.host = "127.0.0.1"
    config.port = 5007
    config.api_key = ""
    config.model_name = "easylm"
    config.max_request_bytes = 1 << 20
    config.max_prompts = 128
    config.max_tokens = 1024
    config.read_timeout = 30.0
    config.keep_alive_timeout = 5.0
    config.max_connections = 256
    config.max_header_bytes = 16384
    config.allowed_hosts = ""
    config.chat_template = ""
    config.add_bos_token = "auto"
    config.chat_prepend_text = ""
    config.chat_user_prefix = "User: "
    config.chat_user_suffix = "\n"
    config.chat_lm_prefix = "Assistant: "
    config.chat_lm_suffix = "\n"
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def check_config(config: ConfigDict):
    for name in ("max_request_bytes", "max_prompts", "max_tokens", "max_connections",
                 "max_header_bytes"):
        if config[name] < 1:
            raise UserError(f"--{name} must be >= 1, got {config[name]}")
    for name in ("read_timeout", "keep_alive_timeout"):
        if not config[name] > 0:
            raise UserError(f"--{name} must be > 0 seconds, got {config[name]}")
    if str(config.add_bos_token).lower() not in ("auto", "true", "false"):
        raise UserError(f"--add_bos_token must be auto, true or false, got "
                        f"{config.add_bos_token!r}")


def check_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode: a lone surrogate "
                         f"{text[e.start]!r} at index {e.start}") from None
    return text


# Every string a client sends: a lone surrogate (JSON's "\ud800") is legal JSON but
# no text, and would otherwise reach the tokenizer.
Text = Annotated[StrictStr, AfterValidator(check_unicode)]


class Service:
    """What the API routes share: the tokenizer, the batcher, limits, and async helpers."""

    def __init__(self, config: ConfigDict, batcher: Batcher, tokenizer, images=None,
                 no_images: str = "this model reads no images"):
        """`images`: an image-text model's reader of images (its family's `image_chats`:
        encode_prompt, batch_inputs), or None and `no_images` saying why."""
        self.config = get_default_config(config)
        check_config(self.config)
        self.batcher, self.tokenizer = batcher, tokenizer
        self.images, self.no_images = images, no_images
        self.seq_length = batcher.engine.seq_length
        self.vocab_size = batcher.engine.model.vocab_size
        self.chat_template = _read_template(self.config.chat_template)
        self.add_bos = str(self.config.add_bos_token).lower()
        bos = tokenizer.bos_token_id
        # What starts a scored text with nothing before it (lm-eval's prefix token).
        self.bos_id = bos if bos is not None else tokenizer.eos_token_id
        # Whether text prompts start with BOS, so EasyLM's scoring reads [BOS] + prefix.
        first = self.encode("a")[:1]
        self.prompts_start_with_bos = first == [self.bos_id] and self.bos_id is not None

    # ---------------------------------------------------------- validation

    def check_model(self, name: str | None):
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "model_not_found")

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids, by --add_bos_token; `special_tokens=False`: the
        text alone (a chat template's output, which has its own)."""
        if special_tokens and self.add_bos == "auto":
            return self.tokenizer(text)["input_ids"]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if special_tokens and self.add_bos == "true" and self.bos_id is not None:
            return [self.bos_id] + ids
        return ids

    def check_prompts(self, count: int, field: str):
        limit = self.config.max_prompts
        if count > limit:
            raise APIError(400, f"{field} has {count} entries, above this server's limit "
                                f"of {limit} per request (--max_prompts)")

    def check_samples(self, n: int, prompts: int):
        """n samples of each of `prompts` prompts: one decode slot each, so n is at most
        the slots, and all of them together at most --max_prompts, like prompts."""
        slots = self.batcher.engine.batch_size
        if not 1 <= n <= slots:
            raise APIError(400, f"n={n} is outside this server's range of 1 to {slots} "
                                f"(its batch slots, --batch_size)")
        limit = self.config.max_prompts
        if prompts * n > limit:
            raise APIError(400, f"n={n} samples of {prompts} prompts are {prompts * n} "
                                f"sequences, above this server's limit of {limit} per "
                                f"request (--max_prompts)")

    def check_sampling(self, top_k: int):
        if top_k > self.vocab_size:
            raise APIError(400, f"top_k={top_k} is above the vocabulary size of "
                                f"{self.vocab_size}")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        template = self.chat_template or self.tokenizer.chat_template
        if not template:
            raise APIError(400, "this model's tokenizer has no chat template; start the "
                                "server with --chat_template=FILE")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors, and templates that raise on bad role order
            raise APIError(400, f"the chat template rejected these messages: {e}")
        return self.encode(text, special_tokens=False)

    def chat_prompt(self, messages: list[dict], references: list[str]):
        """(token ids, image inputs (1, ...) for seq_length tokens or None) of a chat whose
        messages hold `references` (data URLs) in their image parts, in order: each image
        read (`easylm.data.images.read_image`: a remote URL is refused, nothing fetched) and
        encoded by the checkpoint's image processor, its placeholder expanded."""
        ids = self.apply_chat_template(messages)
        if not references:
            return ids, None
        from easylm.data.images import read_image

        if self.images is None:
            raise APIError(400, f"the messages hold {len(references)} image part(s), but "
                                f"{self.no_images}")
        try:
            pictures = [read_image(reference, f"image {k + 1} of the messages")
                        for k, reference in enumerate(references)]
            ids, encoded = self.images.encode_prompt(ids, pictures, "the messages")
            ids = ids.tolist()
        except UserError as e:
            raise APIError(400, str(e)) from None
        image_tokens = len(ids) - len(self.apply_chat_template(messages)) + len(references)
        if len(ids) >= self.seq_length:
            raise APIError(400, f"the prompt has {len(ids)} tokens, {image_tokens} of them "
                                f"its {len(references)} image(s)'; the context is "
                                f"{self.seq_length} tokens, so there is no room to generate")
        try:
            return ids, self.images.batch_inputs([ids], [encoded], self.seq_length)
        except UserError as e:
            raise APIError(400, f"the images do not fit: {e}") from None

    def max_tokens(self, prompt: Sequence[int], requested: int | None, default: int | None = None,
                   field: str = "max_tokens") -> int:
        """The number of new tokens to generate, or a 400 naming the limit that is hit."""
        limit, room = self.config.max_tokens, self.seq_length - len(prompt)
        if not prompt:
            raise APIError(400, "the prompt is empty (no tokens to start from)")
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; the context is "
                                f"{self.seq_length} tokens, so there is no room to generate")
        if requested is None:
            return min(default or limit, limit, room)
        if requested < 1:
            raise APIError(400, f"{field} must be >= 1, got {requested}")
        if requested > limit:
            raise APIError(400, f"{field}={requested} is above this server's limit of {limit}")
        if requested > room:
            raise APIError(400, f"the prompt has {len(prompt)} tokens and {field} is "
                                f"{requested}: together more than the context of "
                                f"{self.seq_length} tokens")
        return requested

    # ---------------------------------------------------------- running

    @staticmethod
    def samples(prompts, params: Sequence[SamplingParams], n: int):
        """Each prompt n times, as OpenAI numbers choices: sequence p * n + i is sample i
        of prompt p, seeded `sample_seed(seed, i)`."""
        return ([p for p in prompts for _ in range(n)],
                [dataclasses.replace(sp, seed=sample_seed(sp.seed, i))
                 for sp in params for i in range(n)])

    def start(self, prompts, params: Sequence[SamplingParams], images=None):
        """Submit one generation per prompt (with `images`, each prompt's image inputs or
        None: `chat_prompt`'s); returns (generations, async iterator of (index, Event)).
        Closing the iterator early cancels what is still running."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        group = object()  # this request's prompts take turns with other requests'
        images = images or [None] * len(prompts)
        gens = [Generation(p, sp, self.tokenizer,
                           lambda e, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, e)),
                           group, x)
                for i, (p, sp, x) in enumerate(zip(prompts, params, images))]
        for i, g in enumerate(gens):
            try:
                self.batcher.submit(g)
            except ValueError as e:  # all or nothing
                for submitted in gens[:i]:
                    self.batcher.cancel(submitted)
                raise APIError(400, str(e))

        async def iterate():
            remaining = len(gens)
            try:
                while remaining:
                    index, event = await events.get()
                    if event.finish_reason or event.error:
                        remaining -= 1
                    yield index, event
            finally:
                for g in gens:
                    if g.finish_reason is None:
                        self.batcher.cancel(g)

        return gens, iterate()

    async def complete(self, request: Request, prompts, params: Sequence[SamplingParams],
                       images=None):
        """Run generations to the end; a client that disconnects cancels them (frees slots)."""
        gens, events = self.start(prompts, params, images)

        async def drain():
            async for _ in events:
                pass

        await _unless_disconnected(request, drain())  # cancelling `drain` cancels the gens
        for g in gens:
            if g.finish_reason == "error":
                raise APIError(500, "generation failed", "server_error")
        return gens

    async def score(self, request: Request, job: Job):
        """A scoring job's answer, scored in chunks between decode calls; a client that
        disconnects cancels the chunks not scored yet."""
        future = self.batcher.score(job.tokens, job.targets)
        return job.finish(await _unless_disconnected(request, asyncio.wrap_future(future)))


def sample_seed(seed: int | None, i: int) -> int | None:
    """Sample i's seed in a request for n samples with `seed`: seed + i, wrapped into int64
    (a request's range), so sample i is what the same request with n=1 and this seed
    gives. No seed: each sample draws its own (they differ)."""
    if seed is None:
        return None
    return (seed + i + 2**63) % 2**64 - 2**63


async def _unless_disconnected(request: Request, work):
    """`await work`, or cancel it and raise a 499 if the client goes away first."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise APIError(499, "client disconnected")
    return work.result()


async def _wait_for_disconnect(request: Request):
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _read_template(value: str) -> str:
    if not value:
        return ""
    if "{" in value:  # the template itself
        return value
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        raise UserError(f"--chat_template={value!r}: cannot read it ({e.strerror})")


def sse(data) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
