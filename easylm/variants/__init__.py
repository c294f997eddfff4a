"""Variants of a family's model: LoRA/QLoRA adapters on a frozen base, int8 weight-only serving."""
