"""lm-eval's `--model easylm` by its former LLaMA-only name: the model of any family is
easylm/evaluation/lm_eval_model.py's, which importing this module registers."""

from easylm.evaluation.lm_eval_model import EasyLMHarnessLM

LLaMAHarnessLM = EasyLMHarnessLM  # the name earlier scripts import

__all__ = ["EasyLMHarnessLM", "LLaMAHarnessLM"]
