"""The splitserve services. Each is a separate OS process (``python -m splitserve.services.<name>``) that talks only
over NATS; they are thin: subscribe, decode, call the policy or the engine, publish."""
