"""python -m easylm.bench decode."""

import pytest


def test_decode_benchmark_reports_both_engines():
    from easylm.llama.family import FAMILY
    from easylm.serving import decode_bench

    config = decode_bench.default_config(FAMILY)
    config.update({"batch_sizes": "2", "prompt_length": 8, "new_tokens": 8,
                   "mesh_dim": "1,-1,1", "hf": "true"})
    rows = decode_bench.run(config, FAMILY)
    assert [r["batch"] for r in rows] == [2]
    for row in rows:
        assert row["easylm_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
        # Warm-up compiled every program the timed run uses: the row times the engine.
        assert row["easylm_timed_compiles"] == 0
        assert row["ratio"] == pytest.approx(row["easylm_tokens_per_s"] / row["hf_tokens_per_s"])
