"""The trainer's printed log: one summary line per log step, and the progress bar's fields."""

from easylm.logger import format_metrics, progress_postfix

STEP = {"loss": 2.5, "accuracy": 0.4, "learning_rate": 1e-3, "gradient_norm": 0.7}


def test_summary_shows_mfu_only_when_known():
    cpu = format_metrics(25, {**STEP, "tokens_per_second": 3637.0, "mfu": None})
    assert cpu == ("step 25 | loss 2.5000 | acc 0.400 | lr 1.00e-03 | grad_norm 0.700 | "
                   "tokens/s 3,637")
    gpu = format_metrics(25, {**STEP, "tokens_per_second": 69012.0, "mfu": 0.571})
    assert gpu.endswith("tokens/s 69,012 | MFU 57.1%")


def test_first_step_says_it_compiles_instead_of_zero_tokens_per_second():
    first = {**STEP, "tokens_per_second": None, "mfu": None}
    assert format_metrics(1, first).endswith("tokens/s n/a (compiling)")
    assert progress_postfix(first) == {"loss": "2.5000", "tokens/s": "compiling"}
    assert progress_postfix({**STEP, "tokens_per_second": 3637.4}) == {
        "loss": "2.5000", "tokens/s": "3,637"}
