"""EasyLM's endpoints, with EasyLM's JSON fields, so its clients and lm-eval adapter work.

    POST /loglikelihood          {prefix_text?, text}  -> {prefix_text, text, log_likelihood, is_greedy}
    POST /loglikelihood-rolling  {text}                -> {text, log_likelihood, is_greedy}
    POST /generate               {prefix_text, temperature?} -> {prefix_text, output_text, temperature}
    POST /greedy-until           {prefix_text, until}  -> {prefix_text, until, max_length, output_text}
    POST /chat                   {prompt, context?, temperature?} -> {response, context, temperature}

All lists are answered in order; their requests share the decode slots, and hold at
most --max_prompts entries. Unlike EasyLM, a prompt too long for the context is a 400
rather than truncated (scoring still truncates a prefix from the left, as EasyLM does).

Text is tokenized as the server's text prompts are (--add_bos_token). Scoring reads
[BOS] + prefix + text, EasyLM's semantics, when those prompts start with BOS (a
LLaMA-style tokenizer); otherwise (a tokenizer that adds no BOS, such as SmolLM2's, or
--add_bos_token=false) it reads prefix + text, with BOS (or EOS when the tokenizer
has none) only before a text whose prefix is empty. The rolling windows always start
with that token.
"""

from typing import Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from easylm.serving import scoring
from easylm.serving.batcher import SamplingParams
from easylm.serving.service import MAX_STOPS, APIError, Service, Text

Temperature = Field(None, ge=0.0, le=2.0)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class LoglikelihoodRequest(_Request):
    prefix_text: list[Text] | None = None
    text: list[Text]


class RollingRequest(_Request):
    text: list[Text]


class GenerateRequest(_Request):
    prefix_text: list[Text]
    temperature: float | None = Temperature


class GreedyUntilRequest(_Request):
    prefix_text: list[Text]
    until: list[Union[Text, list[Text]]]


class ChatRequest(_Request):
    prompt: Text
    context: Text = ""
    temperature: float | None = Temperature


def router(service: Service) -> APIRouter:
    api = APIRouter()
    _scoring_routes(api, service)
    _generation_routes(api, service)
    return api


def _scoring_routes(api: APIRouter, service: Service):
    """/loglikelihood and /loglikelihood-rolling: text scored as EasyLM scores it."""

    def encode_plain(text: str) -> list[int]:
        return service.encode(text, special_tokens=False)

    @api.post("/loglikelihood")
    async def loglikelihood(body: LoglikelihoodRequest, request: Request):
        service.check_prompts(len(body.text), "text")
        prefix = body.prefix_text if body.prefix_text is not None else [""] * len(body.text)
        if len(prefix) != len(body.text):
            raise APIError(400, f"prefix_text has {len(prefix)} entries but text has "
                                f"{len(body.text)}")
        pairs = [(encode_plain(p), encode_plain(t)) for p, t in zip(prefix, body.text)]
        job = scoring.loglikelihood_job(service.seq_length, service.bos_id, pairs,
                                        always_bos=service.prompts_start_with_bos)
        results = await service.score(request, job)
        return {"prefix_text": body.prefix_text, "text": body.text,
                "log_likelihood": [r[0] for r in results], "is_greedy": [r[1] for r in results]}

    @api.post("/loglikelihood-rolling")
    async def loglikelihood_rolling(body: RollingRequest, request: Request):
        service.check_prompts(len(body.text), "text")
        texts = [encode_plain(t) for t in body.text]
        job = scoring.loglikelihood_rolling_job(service.seq_length, service.bos_id, texts)
        results = await service.score(request, job)
        return {"text": body.text, "log_likelihood": [r[0] for r in results],
                "is_greedy": [r[1] for r in results]}


def _generation_routes(api: APIRouter, service: Service):
    """/generate, /greedy-until and /chat: text prompts through the batcher."""
    config = service.config

    async def generate(request: Request, prompts: list[str], params) -> list[str]:
        service.check_prompts(len(prompts), "prefix_text")
        ids = [service.encode(p) for p in prompts]
        params = [SamplingParams(**{**p, "max_tokens": service.max_tokens(i, None)})
                  for i, p in zip(ids, params)]
        return [g.stream.text for g in await service.complete(request, ids, params)]

    @api.post("/generate")
    async def generate_route(body: GenerateRequest, request: Request):
        temperature = 1.0 if body.temperature is None else body.temperature
        outputs = await generate(request, body.prefix_text,
                                 [dict(temperature=temperature)] * len(body.prefix_text))
        return {"prefix_text": body.prefix_text, "output_text": outputs,
                "temperature": temperature}

    @api.post("/greedy-until")
    async def greedy_until(body: GreedyUntilRequest, request: Request):
        if len(body.until) != len(body.prefix_text):
            raise APIError(400, f"until has {len(body.until)} entries but prefix_text has "
                                f"{len(body.prefix_text)}")
        stops = [tuple([u] if isinstance(u, str) else u) for u in body.until]
        for i, s in enumerate(stops):
            if len(s) > MAX_STOPS:
                raise APIError(400, f"until.{i} has {len(s)} stop strings, at most "
                                    f"{MAX_STOPS}")
        outputs = await generate(request, body.prefix_text,
                                 [dict(temperature=0.0, stop=s) for s in stops])
        return {"prefix_text": body.prefix_text, "until": body.until,
                "max_length": config.max_tokens, "output_text": outputs}

    @api.post("/chat")
    async def chat(body: ChatRequest, request: Request):
        temperature = 1.0 if body.temperature is None else body.temperature
        context = (body.context + config.chat_user_prefix + body.prompt
                   + config.chat_user_suffix + config.chat_lm_prefix)
        # The reply ends where the model starts the user's next turn.
        stop = (config.chat_user_prefix.strip(),) if config.chat_user_prefix.strip() else ()
        (response,) = await generate(request, [config.chat_prepend_text + context],
                                     [dict(temperature=temperature, stop=stop)])
        return {"response": response, "context": context + response + config.chat_lm_suffix,
                "temperature": temperature}
