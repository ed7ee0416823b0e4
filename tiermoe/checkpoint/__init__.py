"""Weights on disk: safetensors headers and tensors, GGUF files, the block-FP8 format, and `tiermoe convert` caches.

Readers only: they know file formats, not models (tiermoe.arch maps a config to an architecture, tiermoe.model
maps checkpoint names onto a transformers skeleton).
"""
