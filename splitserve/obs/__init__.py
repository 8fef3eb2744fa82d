"""Observability: structured JSON logs and trace-context propagation shared by every service."""
