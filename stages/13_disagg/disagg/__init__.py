"""Disaggregated prefill and decode (stage 13): a request's KV moved from one engine to another."""
