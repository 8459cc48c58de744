"""How one DeepSeek-V4 step drives the layers: the chunk path (prefill chunks, mixed steps) and one
decode step with its two loops (decode_step.py), with the addressing each builds once a step."""
