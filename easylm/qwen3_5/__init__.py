"""Qwen3.5: Gated DeltaNet hybrids (easylm/qwen3_5/family.py)."""
