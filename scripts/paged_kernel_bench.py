"""Paged attention kernels alone, at a decode step's shape: microseconds per layer call
and the K/V bandwidth each reaches, per page size and block sizes. JAX's ragged paged
attention ("rpa") and ours ("batched": every kv head in a product, its default;
"batched_per_head"; "batched_vpu": easylm/models/paged_decode_kernel.py)
in one run:

    python scripts/paged_kernel_bench.py --batch=64 --heads=16 --kv_heads=16 \
        --context=256 --seq_length=384 --page_sizes=16 --queries_per_block=0,8 \
        --seqs_per_block=2,4,8 --pages_per_step=0,8 --product_keys=64,128 --vpu=0,1

One query per sequence (a decode step), every sequence `context` keys (its pages spread
over the pool at random), `layers` calls chained in one program (each call's output is
the next one's query) so the time is the device's. A JSON line per setting: the K/V bytes
a call must read over 819 GB/s (the v5e's HBM) for comparison, and for the batched kernel
its largest difference from JAX's kernel on the same inputs (bf16: ~1e-2 expected).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.models.paged_attention import decode_attention, ragged_paged_attention
from easylm.models.paged_decode_kernel import (PRODUCT_KEYS, batched_decode_attention,
                                               default_blocks, product_pages)

HBM = 819e9  # bytes/s, one v5e chip


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=16)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--seq_length", type=int, default=384)
    parser.add_argument("--page_sizes", default="16")
    parser.add_argument("--queries_per_block", default="0",
                        help="rpa's, comma-separated; 0: the engine's "
                             "(paged_attention.decode_attention); empty: rpa not run")
    parser.add_argument("--seqs_per_block", default="4",
                        help="batched's, comma-separated; empty: batched not run")
    parser.add_argument("--pages_per_step", default="0",
                        help="batched's pages per sequence per grid step, comma-separated; "
                             "0: its default (paged_decode_kernel.default_blocks)")
    parser.add_argument("--product_keys", default="0",
                        help="batched's keys per product (a multiple of the page size), "
                             "comma-separated; 0: its default (PRODUCT_KEYS, at most the "
                             "step's)")
    parser.add_argument("--vpu", default="0",
                        help="batched's products: 0 on the MXU, 1 on the VPU; comma-separated")
    parser.add_argument("--all_heads", default="1",
                        help="batched's products: 1 over every kv head at once (one MXU "
                             "product and one softmax update a sequence and product: the "
                             "kernel's default), 0 one kv head at a time (batched_per_head); "
                             "comma-separated")
    parser.add_argument("--group", type=int, default=0,
                        help="> 1: sequences in groups of this many sharing their first "
                             "--shared positions (GRPO's completions of a prompt), JAX's "
                             "kernel over each whole table against the cascade "
                             "(paged_attention.shared_prefix_attention, our kernel)")
    parser.add_argument("--shared", type=int, default=512)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    B, N, K, H = args.batch, args.heads, args.kv_heads, args.head_dim
    if args.group > 1:
        return grouped(args)
    rng = np.random.default_rng(0)
    kv_bytes = B * args.context * 2 * K * H * 2
    for Z in _ints(args.page_sizes):
        W = -(-args.seq_length // Z)
        P = B * W
        pool = jax.random.normal(jax.random.PRNGKey(0), (P, Z, 2 * K, H), jnp.bfloat16)
        table = jnp.asarray(rng.permutation(P).reshape(B, W), jnp.int32)
        lengths = jnp.full((B,), args.context, jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(1), (B, N, H), jnp.bfloat16)
        settings = [("rpa", bq) for bq in _ints(args.queries_per_block)]
        for vpu in _ints(args.vpu):
            for together in [0] if vpu else _ints(args.all_heads):
                for blocks in _blocks(args, B, W, Z, K, H):
                    settings.append(("batched_vpu" if vpu else
                                     "batched" if together else "batched_per_head", blocks))
        reference = None
        for kernel, setting in settings:
            def attend(q, kernel=kernel, setting=setting):
                if kernel != "rpa":
                    # Off a TPU (a smoke run of this script): interpret mode, slow.
                    return batched_decode_attention(
                        q, pool, lengths, table, 1 / np.sqrt(H), blocks=setting,
                        vpu=kernel == "batched_vpu", all_heads=kernel == "batched",
                        interpret=jax.default_backend() != "tpu")
                if setting == 0:
                    return decode_attention(q, pool, lengths, table)
                return ragged_paged_attention(
                    q, pool, lengths, table, jnp.arange(B + 1, dtype=jnp.int32),
                    jnp.array([B], jnp.int32), block_sizes=(W, setting))

            row = {"kernel": kernel, "page_size": Z,
                   ("queries_per_block" if kernel == "rpa" else "blocks"): setting or "engine"}
            try:
                once = jax.jit(attend)(q).astype(jnp.float32)
                if kernel == "rpa" and reference is None:
                    reference = once
                elif kernel != "rpa" and reference is not None:
                    row["max_abs_diff_from_rpa"] = float(jnp.max(jnp.abs(once - reference)))
                us = _timed(attend, q, args.layers, args.calls)
                row.update(us_per_layer=us, kv_gb_per_s=kv_bytes / us / 1e3,
                           hbm_fraction=kv_bytes / us / 1e-6 / HBM,
                           us_at_819=kv_bytes / HBM * 1e6)
            except Exception as e:  # a block size a kernel refuses: say so, go on
                row["error"] = repr(e)[:300]
            print(json.dumps(row), flush=True)


def _blocks(args, B, W, Z, K, H):
    """The kernel's (sequences a block, pages a step, pages a product) settings swept."""
    out = []
    for b in _ints(args.seqs_per_block):
        for c in _ints(args.pages_per_step):
            for keys in _ints(args.product_keys):
                b_, c_, u = default_blocks(B, W, Z * 2 * K * H * 2, Z, b)
                if c or keys:  # else the kernel's own default, as the engine runs it
                    c_ = c or c_
                    u = product_pages(c_, Z, keys or PRODUCT_KEYS)
                if (b_, c_, u) not in out:
                    out.append((b_, c_, u))
    return out


def _timed(attend, q, layers: int, calls: int) -> float:
    """Microseconds a layer: `layers` calls chained in one program, `calls` programs."""
    chain = jax.jit(lambda q: jax.lax.fori_loop(0, layers, lambda _, q: attend(q), q))
    jax.block_until_ready(chain(q))
    start = time.perf_counter()
    for _ in range(calls):
        out = chain(q)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / (calls * layers) * 1e6


def grouped(args):
    """--group: B sequences in groups sharing their first `shared` positions' pages (the
    rest `context - shared` their own); a row each for JAX's kernel over every whole table
    and for the cascade, with the K/V bytes each must read and its difference from JAX's."""
    from easylm.models.paged_attention import SharedPrefix, shared_prefix_attention

    B, N, K, H, Z = args.batch, args.heads, args.kv_heads, args.head_dim, \
        int(args.page_sizes.split(",")[0])
    E, shared_pages = B // args.group, args.shared // Z
    W = -(-args.seq_length // Z)
    own = -(-args.context // Z) - shared_pages
    P = 1 + E * shared_pages + B * own
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(1, P))
    prompt = order[:E * shared_pages].reshape(E, shared_pages)
    rest = order[E * shared_pages:].reshape(B, own)
    table = np.zeros((B, W), np.int32)
    for b in range(B):
        table[b, :shared_pages], table[b, shared_pages:shared_pages + own] = \
            prompt[b // args.group], rest[b]
    members = np.arange(B, dtype=np.int32).reshape(E, args.group)
    prefix = SharedPrefix(
        table=jnp.asarray(np.pad(prompt, ((0, 0), (0, W - shared_pages))), jnp.int32),
        length=jnp.full((E,), args.shared, jnp.int32), members=jnp.asarray(members),
        group=jnp.asarray(np.arange(B) // args.group, jnp.int32),
        member=jnp.asarray(np.arange(B) % args.group, jnp.int32),
        shared=jnp.full((B,), args.shared, jnp.int32))
    pool = jax.random.normal(jax.random.PRNGKey(0), (P, Z, 2 * K, H), jnp.bfloat16)
    lengths = jnp.full((B,), args.context, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (B, N, H), jnp.bfloat16)
    table = jnp.asarray(table)
    position = 2 * K * H * 2  # bytes of one position's keys and values
    ways = {("rpa", None): (lambda q: decode_attention(q, pool, lengths, table),
                            B * args.context * position)}
    for blocks in _blocks(args, B, W, Z, K, H):  # the cascade at each of the kernel's settings
        ways["cascade", blocks] = (
            lambda q, blocks=blocks: shared_prefix_attention(
                q, pool, lengths, table, prefix, kernel="batched", blocks=blocks),
            (E * args.shared + B * (args.context - args.shared)) * position)
    reference = None
    for (name, setting), (attend, kv_bytes) in ways.items():
        row = {"kernel": name, "page_size": Z, "group": args.group, "shared": args.shared,
               "context": args.context, **({"blocks": setting} if setting else {})}
        try:
            once = jax.jit(attend)(q).astype(jnp.float32)
            if reference is None:
                reference = once
            else:
                row["max_abs_diff_from_rpa"] = float(jnp.max(jnp.abs(once - reference)))
            us = _timed(attend, q, args.layers, args.calls)
            row.update(us_per_layer=us, kv_mb=kv_bytes / 1e6, us_at_819=kv_bytes / HBM * 1e6,
                       hbm_fraction=kv_bytes / us / 1e-6 / HBM)
        except Exception as e:  # noqa: BLE001 (a kernel Mosaic refuses: say so, go on)
            row["error"] = repr(e)[:300]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
