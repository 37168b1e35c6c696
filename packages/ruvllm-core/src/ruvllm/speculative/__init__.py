"""Speculative decoding as a propose/verify pair.

A proposer (:mod:`~ruvllm.speculative.ngram`: prompt lookup; :mod:`~ruvllm.speculative.draft`: a second
model) offers up to ``k`` tokens that may follow a sequence;
the engine runs them with the sequence's next position as one chunk of ``k + 1`` positions and the
verifier (:mod:`~ruvllm.speculative.verify`) keeps the longest prefix the target model would have
produced, plus one token of its own. The proposer knows nothing of the target; the verifier knows
nothing of where a draft came from; rejection sampling (Leviathan et al., 2023) sits in one function,
:func:`~ruvllm.speculative.rejection.accept_or_resample`. Per-sequence adaptivity (how many tokens
to draft) is :mod:`~ruvllm.speculative.adaptive`; what drafts cost at the step's load,
:mod:`~ruvllm.speculative.step_cost`; which proposer drafts for a sequence when both may,
:mod:`~ruvllm.speculative.source`.
"""

from ruvllm.speculative.adaptive import DraftLength
from ruvllm.speculative.ngram import NgramIndex
from ruvllm.speculative.rejection import accept_or_resample, rejection_sample
from ruvllm.speculative.step_cost import StepCosts
from ruvllm.speculative.verify import SpeculationStats, verify_draft

#: Values of ``EngineConfig.speculative`` (None: off).
#: ``ngram+draft``: the prompt lookup where it matches and pays, the draft model otherwise.
SPECULATIVE_METHODS = ("ngram", "draft", "ngram+draft")
#: The most tokens one sequence may draft per step.
MAX_SPECULATIVE_TOKENS = 16

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "SPECULATIVE_METHODS",
    "DraftLength",
    "NgramIndex",
    "SpeculationStats",
    "StepCosts",
    "accept_or_resample",
    "rejection_sample",
    "verify_draft",
]
