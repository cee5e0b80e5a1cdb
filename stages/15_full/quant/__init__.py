"""Quantization (stage 14): weight formats, quantized layers and matmuls, a quantized KV cache."""
