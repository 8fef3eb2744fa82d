"""The prefill worker: computes a prompt's KV and pushes it into the blocks its target decoder reserved."""
