"""Speculative decoding (stage 08): drafters propose tokens, rejection sampling verifies them."""
