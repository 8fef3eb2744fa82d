"""Mechanism shared by the services: the NATS bus wrapper, the worker lifecycle, the worker registry."""
