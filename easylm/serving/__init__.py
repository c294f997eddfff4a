"""Serving: a batched KV-cache generation engine, scoring, and an HTTP server.

    cli.py            setup for any model family: flags -> model -> parameters -> engine -> HTTP
    engine.py         weights, the KV cache, jitted prefill / decode / score (device side)
    batcher.py        continuous batching: requests take free slots between decode calls
    sampling.py       greedy / temperature / top-k / top-p on the device
    text.py           incremental detokenization and stop strings
    scoring.py        log-likelihood, rolling log-likelihood (EasyLM semantics), is-greedy
    server.py         FastAPI app: auth, errors, health, the chat page
    service.py        what the routes share: settings, the Service, request errors and checks
    limits.py         what one client can make the server hold: bytes, time, connections
    openai_api.py     the OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions
    easylm_api.py     EasyLM's API: /loglikelihood, /generate, /greedy-until, /chat, ...
    decode_bench.py   `python -m easylm.bench decode`: decode tokens/s, and the ratio to HF
    static/chat.html  the chat page served at /
"""
