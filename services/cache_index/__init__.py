"""The cache-index service: prefix residency per worker, fed by the workers' own KV events."""
