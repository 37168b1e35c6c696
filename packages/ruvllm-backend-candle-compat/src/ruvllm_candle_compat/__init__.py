"""ruvllm's NumPy float32 backend ("candle-compat"): the Llama family over a paged KV cache."""

from ruvllm_candle_compat.kv_cache import PagedKVCache, TwoTierKVCache
from ruvllm_candle_compat.model import CandleCompatModel

__all__ = ["CandleCompatModel", "PagedKVCache", "TwoTierKVCache"]
