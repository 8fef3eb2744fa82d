"""splitserve: a control plane for disaggregated prefill/decode LLM inference over NATS."""
