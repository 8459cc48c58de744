"""DeepSeek-V4 model family: config, model, cache state, and planner size functions."""

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.cache_state import (
    DeepseekV4CacheState,
    SlotExport,
    deepseek_v4_cache_bytes,
)
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.runner import DeepseekV4Runner
from engine.models.deepseek_v4.state_rows import DeepseekV4StateRows, StateRowLayout

__all__ = [
    "V4Backend",
    "DeepseekV4CacheState",
    "DeepseekV4Config",
    "DeepseekV4Model",
    "DeepseekV4Runner",
    "DeepseekV4StateRows",
    "SlotExport",
    "StateRowLayout",
    "deepseek_v4_cache_bytes",
]
