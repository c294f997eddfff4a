"""Llama 4's text model (llama4_text): easylm/llama4/model.py."""
