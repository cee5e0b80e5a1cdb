"""The KV connector seam (stage 12): KV blocks that enter or leave the pool without compute."""
