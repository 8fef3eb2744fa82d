"""The decode worker: reserves landing blocks for incoming KV, prefills short prompts locally, and streams
tokens for all its active sequences with one batched decode step at a time."""
