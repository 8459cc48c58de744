"""DeepSeek-V4 weights: checkpoint layouts and formats (FP8, MXFP4), the quantized modules that
hold them, test and dummy checkpoints, weight bytes, and the tensor-parallel cut."""
