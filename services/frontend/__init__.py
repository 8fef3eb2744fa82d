"""The OpenAI-compatible HTTP front door: a stateless translator between HTTP/SSE and the NATS request path.

``openai_api`` owns the wire shapes (request models, response and chunk builders, error mapping) and does no
I/O; ``app`` owns the HTTP surface (routes, auth, request ids, streaming and disconnects); ``service`` owns
the process (NATS connection, heartbeats, readiness, the embedded uvicorn server).
"""
