"""lm-evaluation-harness in-process on the serving engine, and the trainer's `--eval_harness.*` hook."""
