"""Suite-wide settings. Fixtures of one area live in that area's conftest.py."""

import os

import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the CPU tier runs the Triton kernels through the interpreter; this must be set
# before triton is first imported, which is why it lives at the root of the suite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
