"""Sampling: how the next token is chosen from a step's logits.

One definition, three ways to run it. :class:`SamplingParams` says what a request asks
(:mod:`~ruvllm.sampling.params`, validated when the engine takes the request). :class:`Sampler` is the
reference: per choice, the order in which penalties, bias, bans, the grammar's mask, temperature and
the filters apply (:mod:`~ruvllm.sampling.reference`). The engine samples a step's rows on the host
with :func:`sample_batch` (:mod:`~ruvllm.sampling.batch`: the same tokens as the reference), or has a
backend apply the parameters on its device to rows :func:`device_sampling` builds
(:mod:`~ruvllm.sampling.device`: the same tokens up to float32 rounding). Backends that sample on
their device apply the parameters there too; the reference is what they are tested against.
"""

from ruvllm.sampling.batch import sample_batch
from ruvllm.sampling.device import (
    OVERLAY_WIDTHS,
    DeviceOverlay,
    device_row,
    device_sampling,
    overlay_width,
    overlay_widths,
)
from ruvllm.sampling.params import SamplingParams
from ruvllm.sampling.reference import Sampler, SampleResult, TokenObserver, log_softmax, top_ids
from ruvllm.sampling.selection import argmax_rows

__all__ = [
    "OVERLAY_WIDTHS",
    "DeviceOverlay",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "TokenObserver",
    "argmax_rows",
    "device_row",
    "device_sampling",
    "log_softmax",
    "overlay_width",
    "overlay_widths",
    "sample_batch",
    "top_ids",
]
