"""DeepSeek-V4 KV memory: the pool of blocks and per-slot carry, its KVLayout, window snapshots,
the KV extent's sizes (extent.py) and a step's scratch and peak for the plan."""
