"""Observability (stage 15): Prometheus metrics, request traces and the live view."""
