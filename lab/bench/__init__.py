"""Benchmarks of the kernels, the engine, DeepSeek-V4 and the KV handoff (`python -m lab.bench.X`).
Each builds the product from the settings a user would pass; results go to lab/results."""
