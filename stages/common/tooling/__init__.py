"""What drives, measures and checks the engine, and is not the engine: workloads, the load
client, latency statistics and benchmark records, the transformers oracle, tiny checkpoints,
server processes for tests, the browser driver, and the cost models and simulations the
benchmarks plot. No stage's engine module imports it; only benches, tests and tools do."""
