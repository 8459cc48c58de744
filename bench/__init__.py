"""Benchmarks and the `bulkhead bench` load generator. No runtime package imports this."""
