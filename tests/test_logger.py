"""metrics.jsonl rows and the one-line summary, with non-finite values too."""

import json
import time

from easylm import logger


def test_rows_carry_their_wall_clock_time_and_nan_is_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    log = logger.Logger(logger.get_default_config(), str(tmp_path), {}, total_steps=2)
    before = time.time()
    log.log(1, {"loss": 2.5, "learning_rate": 1e-3})
    log.log(2, {"loss": float("nan"), "learning_rate": float("nan"), "gradient_norm": float("inf")})
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2]
    assert before <= rows[0]["time"] <= rows[1]["time"] <= time.time()
    assert rows[1]["loss"] == "nan"  # JSON has no NaN: kept as text
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1 | loss 2.5000 | lr 1.00e-03")
    assert out[1].startswith("step 2 | loss nan | lr nan | grad_norm inf")
