"""The model-family boundary (`ModelFamily`, `Model`), the registry of families, and the building blocks families share (attention, remat, Hugging Face checkpoint files)."""
