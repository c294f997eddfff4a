"""easylm: pre-train, fine-tune, evaluate and serve LLaMA-family models in JAX/Flax."""

import os

# transformers announces at import that PyTorch is missing and "models won't be
# available"; easylm uses it for tokenizers and configs only, which need no torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
