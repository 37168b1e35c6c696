"""ruvllm's NumPy float32 backend ("candle-compat"): the Llama family over a paged KV cache."""

from ruvllm_candle_compat.model import CandleCompatModel, PagedKVCache

__all__ = ["CandleCompatModel", "PagedKVCache"]
