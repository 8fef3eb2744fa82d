"""Pure benchmarks of the policy layer (no services, no NATS): ``python -m bench.index_bench`` etc."""
