"""Serving: a batched KV-cache generation engine, scoring, and an HTTP server.

    engine.py    weights, the KV cache, jitted prefill / decode / score (device side)
    batcher.py   continuous batching: requests take free slots between decode calls
    sampling.py  greedy / temperature / top-k / top-p on the device
    text.py      incremental detokenization and stop strings
    scoring.py   log-likelihood, rolling log-likelihood (EasyLM semantics), is-greedy
    server.py    FastAPI app: auth, limits, errors, health, the chat page
    openai_api.py, easylm_api.py   the two HTTP APIs
    static/chat.html                the chat page served at /
    bench.py     decode throughput, and the ratio to HF transformers on CPU
"""
