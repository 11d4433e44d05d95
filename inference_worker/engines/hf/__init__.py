"""Hugging Face engines: transformers models, batched decoding with frame KV reuse, grammar-constrained sampling, MiniCPM-o."""
