"""DeepSeek-V4 modules and their maths: attention, compressor, indexer, mHC, MoE, norms, RoPE,
merged projections, the decoder layer. Parameters and per-token arithmetic; how a step drives
them is step/'s."""
