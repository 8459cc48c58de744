"""DeepSeek-V4 model family: config, model, KV pool in blocks, and the family contract."""

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool, deepseek_v4_cache_bytes
from engine.models.deepseek_v4.model import DeepseekV4Model

__all__ = [
    "V4Backend",
    "DeepseekV4Config",
    "DeepseekV4KVPool",
    "DeepseekV4Model",
    "deepseek_v4_cache_bytes",
]
