"""ruvllm JAX backend: jitted forward, paged KV cache on device, Pallas kernels, quantized weights."""

__version__ = "0.1.0"
