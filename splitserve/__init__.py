"""splitserve: a control plane for disaggregated prefill/decode LLM inference over NATS."""

from splitserve.runtime import natsflush as _natsflush

# nats-py's flush() lets its PING overtake queued SUB/PUB commands; see splitserve.runtime.natsflush
_natsflush.apply()
