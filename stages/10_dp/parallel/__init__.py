"""Tensor parallelism (stage 09): the rank group, sharded layers, executors, worker processes."""
