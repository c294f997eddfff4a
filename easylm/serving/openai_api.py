"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

What clients rely on is supported: several prompts, string or token-id prompts,
`n` samples of each (choice p * n + i is sample i of prompt p, seeded
`service.sample_seed(seed, i)` = seed + i), `stream` (server-sent events, with
`stream_options.include_usage`), `stop`, `seed`, `logprobs`, and `echo` with
`max_tokens` 0 or 1, which lm-evaluation-harness's `local-completions` uses to score
log-likelihoods. `top_k` is accepted as an extension. Options that would change the
output but are not implemented (penalties, logit_bias) are 400 errors, never ignored;
so are numbers the device could not represent (a top_p that float32 flushes to 0,
a top_k above the vocabulary, a seed beyond 64 bits).

Chat messages may hold OpenAI's image parts (`{"type": "image_url", "image_url": {"url":
DATA_URL}}`) for an image-text model (`Service.chat_prompt`; docs/vision.md): a remote URL,
an unreadable image or images too large for the context are 400s.
"""

import time
import uuid
from typing import Annotated, Any, Literal, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from easylm.serving import scoring
from easylm.serving.batcher import SamplingParams, Token
from easylm.serving.sampling import TOP_LOGPROBS
from easylm.serving.service import MAX_STOPS, APIError, Service, Text, check_unicode, sse

Stop = Union[Text, list[Text], None]
# float32's smallest normal number: below it top_p is flushed to 0 on the device.
MIN_TOP_P = float(np.finfo(np.float32).tiny)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: Text | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extension (vLLM's); 0 or -1: off; at most the vocabulary
    n: int = 1  # samples per prompt; Service.check_samples says which are allowed
    stream: bool = False
    stream_options: dict | None = None
    stop: Stop = Field(None)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)  # int64, as OpenAI and vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: Text | None = None

    @field_validator("top_p")
    @classmethod
    def _representable(cls, top_p):
        if top_p < MIN_TOP_P:
            raise ValueError(f"must be at least {MIN_TOP_P:.3g}: below, float32 (the device's "
                             f"type) holds it as 0")
        return top_p

    def check_supported(self, service: Service):
        service.check_sampling(self.top_k)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; leave it at 0")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop has {len(stops)} strings, at most {MAX_STOPS}")
        return tuple(stops)

    def sampling(self, max_tokens: int, stops) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
                              stop=stops)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: Any
    max_tokens: int | None = None
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        """-> a non-empty list of prompts, each a string or a list of token ids."""
        def ids(x):
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(prompt, str) or (ids(prompt) and prompt):
            prompt = [prompt]
        if not (isinstance(prompt, list) and all(isinstance(p, str) or ids(p) for p in prompt)):
            raise ValueError("must be a string, a list of strings, a list of token ids, "
                             "or a list of token-id lists")
        if not prompt or any(len(p) == 0 for p in prompt):
            raise ValueError("must not be empty")
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                try:
                    check_unicode(p)
                except ValueError as e:
                    raise ValueError(f"entry {i} {e}") from None
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ImageURL(BaseModel):
    url: Text
    detail: Text | None = None  # OpenAI's; the checkpoint's image processor decides


class ImagePart(BaseModel):
    """OpenAI's image part: {"type": "image_url", "image_url": {"url": DATA_URL}}."""
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Text, list[Part]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[str]:
        """Its image parts' URLs, in order."""
        return [] if isinstance(self.content, str) else [
            p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def for_template(self) -> dict:
        """The message as the chat template reads it: text parts joined into one string,
        unless it holds images (then its parts, each image a {"type": "image"})."""
        if not self.images():
            return {"role": self.role, "content": self.text()}
        return {"role": self.role, "content": [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in self.content]}


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)


def _token_text(service: Service, token: int) -> str:
    return service.tokenizer.decode([token])


def _completion_logprobs(service: Service, ids, logprobs, tops, k: int, offset: int):
    """OpenAI's completions `logprobs` object for tokens starting at text offset `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in zip(ids, logprobs, tops):
        text = _token_text(service, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(
            None if top is None else {_token_text(service, i): p for i, p in top[:k]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _merge_logprobs(a: dict | None, b: dict) -> dict:
    return b if a is None else {key: a[key] + b[key] for key in a}


def _chat_logprobs(service: Service, tokens: list[Token], k: int):
    def entry(token, logprob):
        text = _token_text(service, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t.id, t.logprob),
                         "top_logprobs": [entry(i, p) for i, p in t.top[:k]]} for t in tokens]}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens served from another request's run
    of the same prompt, or with --page_size from the pages an earlier request's prompt
    left (the engine's share_prompts)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached(gens, n: int) -> int:
    """Cached prompt tokens as OpenAI counts prompts, once each: a prompt's n samples
    (gens[i * n: (i + 1) * n]) count it cached when none of them ran it."""
    return sum(min(g.cached_tokens for g in gens[i:i + n]) for i in range(0, len(gens), n))


def router(service: Service) -> APIRouter:
    api = APIRouter()
    name = service.config.model_name

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "easylm",
            "max_model_len": service.seq_length,
            # easylm's: the largest max_tokens a request may ask for (the chat page's limit)
            "max_tokens": service.config.max_tokens}]}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _completions(service, body, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _chat_completions(service, body, request)

    return api


async def _completions(service: Service, body: CompletionRequest, request: Request):
    service.check_model(body.model)
    stops = body.check_supported(service)
    prompts, texts = _completion_prompts(service, body)
    service.check_samples(body.n, len(prompts))
    # max_tokens=0 (with echo) only scores the prompt.
    limits = [service.max_tokens(p, body.max_tokens, default=16)
              for p in prompts] if body.max_tokens != 0 else None
    echo = await _echo_prefix(service, request, body, prompts, texts)
    prefix = lambda i: echo(i // body.n)  # choice i is a sample of prompt i // n
    common = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
              "created": int(time.time()), "model": service.config.model_name}
    # OpenAI counts each prompt's tokens once, however many samples it has.
    prompt_tokens = sum(map(len, prompts))
    if limits is None:
        return _echo_only(body, common, len(prompts) * body.n, prefix, prompt_tokens)
    sequences, params = service.samples(prompts, [body.sampling(m, stops) for m in limits],
                                        body.n)
    if body.stream:
        return StreamingResponse(_stream_completion(service, body, common, sequences, params,
                                                    prefix, prompt_tokens),
                                 media_type="text/event-stream")
    gens = await service.complete(request, sequences, params)
    return {**common, "choices": [_completion_choice(service, i, g, prefix, body.logprobs)
                                  for i, g in enumerate(gens)],
            "usage": _usage(prompt_tokens, sum(len(g.tokens) for g in gens),
                            _cached(gens, body.n))}


async def _chat_completions(service: Service, body: ChatRequest, request: Request):
    service.check_model(body.model)
    stops = body.check_supported(service)
    service.check_samples(body.n, 1)
    prompt, images = service.chat_prompt([m.for_template() for m in body.messages],
                                         [url for m in body.messages for url in m.images()])
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if field == "max_completion_tokens" else body.max_tokens
    sequences, params = service.samples(
        [prompt], [body.sampling(service.max_tokens(prompt, requested, field=field), stops)],
        body.n)
    k = (body.top_logprobs or 0) if body.logprobs else None
    common = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
              "model": service.config.model_name}
    images = [images] * len(sequences)
    if body.stream:
        return StreamingResponse(_stream_chat(service, body, common, sequences, params, k,
                                              images), media_type="text/event-stream")
    gens = await service.complete(request, sequences, params, images)
    return {**common, "object": "chat.completion", "choices": [{
        "index": i, "message": {"role": "assistant", "content": g.stream.text},
        "logprobs": None if k is None else _chat_logprobs(service, g.tokens, k),
        "finish_reason": g.finish_reason} for i, g in enumerate(gens)],
        "usage": _usage(len(prompt), sum(len(g.tokens) for g in gens), _cached(gens, body.n))}


def _completion_prompts(service: Service, body: CompletionRequest):
    """(each prompt's token ids, its text or None for a token-id prompt), checked."""
    prompt = body.prompt  # a list of strings and token-id lists (see the validator)
    service.check_prompts(len(prompt), "prompt")
    texts = [p if isinstance(p, str) else None for p in prompt]
    prompts = [service.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    for ids in prompts:
        if any(not 0 <= t < service.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {service.vocab_size})")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 is allowed only with echo=true)")
    return prompts, texts


async def _echo_prefix(service: Service, request: Request, body: CompletionRequest, prompts,
                       texts):
    """`prefix(i)`: what choice i starts with, (text, logprobs): with echo, the prompt's
    text (and, with logprobs, its tokens' log-probabilities, scored here); else nothing."""
    if not body.echo:
        return lambda i: ("", None)
    k, echoed = body.logprobs, None
    if k is not None:
        echoed = await service.score(request, scoring.prompt_logprobs_job(service.seq_length,
                                                                          prompts))
    texts = [t if t is not None else service.tokenizer.decode(p) for t, p in zip(texts, prompts)]

    def prefix(i):
        lp = None if echoed is None else _completion_logprobs(service, prompts[i], *echoed[i], k, 0)
        return texts[i], lp

    return prefix


def _echo_only(body: CompletionRequest, common: dict, choices: int, prefix, prompt_tokens: int):
    """max_tokens=0: the echoed prompts (n times each), nothing generated."""
    choices = [{"index": i, "text": text, "logprobs": lp, "finish_reason": "length"}
               for i, (text, lp) in enumerate(map(prefix, range(choices)))]
    usage = _usage(prompt_tokens, 0)
    if body.stream:
        return _stream_once(common, choices, usage if body.include_usage else None)
    return {**common, "choices": choices, "usage": usage}


def _completion_choice(service: Service, i: int, generation, prefix, k: int | None) -> dict:
    text, lp = prefix(i)
    if k is not None:
        tokens = generation.tokens
        lp = _merge_logprobs(lp, _completion_logprobs(
            service, [t.id for t in tokens], [t.logprob for t in tokens], [t.top for t in tokens],
            k, len(text)))
    return {"index": i, "text": text + generation.stream.text, "logprobs": lp,
            "finish_reason": generation.finish_reason}


def _stream_once(common, choices, usage):
    async def events():
        yield sse({**common, "choices": choices})
        if usage is not None:
            yield sse({**common, "choices": [], "usage": usage})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def _stream_completion(service: Service, body, common, sequences, params, prefix,
                             prompt_tokens: int):
    """Choice i's chunks carry index i (sequence i: a sample of prompt i // n)."""
    k = body.logprobs
    gens, events = service.start(sequences, params)
    offsets, generated = [0] * len(sequences), [0] * len(sequences)
    for i in range(len(sequences)):
        text, lp = prefix(i)
        offsets[i] = len(text)
        if text:
            yield sse({**common, "choices": [{"index": i, "text": text, "logprobs": lp,
                                              "finish_reason": None}]})
    async for i, event in events:
        if event.error:
            yield sse({"error": {"message": "generation failed", "type": "server_error"}})
            return
        generated[i] += len(event.tokens)
        lp = None
        if k is not None:
            lp = _completion_logprobs(service, [t.id for t in event.tokens],
                                      [t.logprob for t in event.tokens],
                                      [t.top for t in event.tokens], k, offsets[i])
        offsets[i] += len(event.text)
        if event.text or event.finish_reason or lp:
            yield sse({**common, "choices": [{"index": i, "text": event.text, "logprobs": lp,
                                              "finish_reason": event.finish_reason}]})
    if body.include_usage:
        yield sse({**common, "choices": [], "usage": _usage(prompt_tokens, sum(generated),
                                                            _cached(gens, body.n))})
    yield sse("[DONE]")


async def _stream_chat(service: Service, body, common, sequences, params, k, images):
    """Choice i's chunks carry index i, each choice opening with its role, as OpenAI's."""
    gens, events = service.start(sequences, params, images)
    common = {**common, "object": "chat.completion.chunk"}
    for i in range(len(sequences)):
        yield sse({**common, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
    generated = 0
    async for i, event in events:
        if event.error:
            yield sse({"error": {"message": "generation failed", "type": "server_error"}})
            return
        generated += len(event.tokens)
        lp = None if k is None else _chat_logprobs(service, event.tokens, k)
        delta = {"content": event.text} if event.text else {}
        if delta or event.finish_reason or (lp and lp["content"]):
            yield sse({**common, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                              "finish_reason": event.finish_reason}]})
    if body.include_usage:  # the prompt once, as OpenAI counts it
        yield sse({**common, "choices": [], "usage": _usage(len(sequences[0]), generated,
                                                            _cached(gens, body.n))})
    yield sse("[DONE]")
