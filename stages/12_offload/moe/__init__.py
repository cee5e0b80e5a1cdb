"""Mixture of experts (stage 11): sparse MoE layers and expert parallelism."""
