"""DeepSeek-V4 model family, by concern:

* ``config.py`` / ``backend.py``: the checkpoint's config and the kernel choices (leaves);
* ``layers/``: the modules and their maths (attention, compressor, indexer, mHC, MoE, norms,
  RoPE, merged projections, the decoder layer);
* ``step/``: how one step drives the layers: prefill chunks (and mixed steps), and one decode
  step with its two loops (``step/decode_step.py``);
* ``memory/``: the KV pool and its layout, window snapshots, the KV extent's sizes, step peaks;
* ``weights/``: checkpoint layouts and formats, quantized modules, tensor-parallel slicing;
* ``model.py``: the causal LM; ``family.py``: the engine's ModelFamily contract.
"""

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.memory.extent import deepseek_v4_cache_bytes
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool
from engine.models.deepseek_v4.model import DeepseekV4Model

__all__ = [
    "V4Backend",
    "DeepseekV4Config",
    "DeepseekV4KVPool",
    "DeepseekV4Model",
    "deepseek_v4_cache_bytes",
]
