"""Pallas kernels (CUDA through the Triton lowering; any device with ``interpret=True``)."""

from ruvllm_jax.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention"]
