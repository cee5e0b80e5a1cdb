"""KV offloading (stage 12): a host-memory tier behind the device pool, and its block copies."""
