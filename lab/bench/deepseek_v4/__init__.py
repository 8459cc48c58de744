"""DeepSeek-V4 benchmarks: the context sweep, decode rates, and resuming long conversations."""
