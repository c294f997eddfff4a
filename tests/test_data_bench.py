"""`python -m easylm.data.throughput`: every measurement it reports, on a small corpus."""

import json

from easylm.data.embedded.stories import documents
from easylm.data.throughput import bench_data


def test_bench_measures_text_cache_and_mixture(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(60, seed=2)))
    mixture = json.dumps([{"name": "a", "weight": 1, "path": str(path)}])
    r = bench_data(str(path), workers=(1,), seq_length=64, batch_size=2, epochs=1, copies=2,
                   cache_processes=(1,), mixture=mixture, seconds=0)
    assert r["documents"] == 120
    for key in ("pipeline_1", "cache_build_1", "cache_pipeline", "mixture_pipeline"):
        assert r[key] > 0 and r[f"ratio_{key}"] == r[key] / r["raw"]
    assert r["cache_build_1_start_seconds"] == 0   # built in this process
