"""Adapter routing: a plugin's router (``InferenceRequest.adapter_router``) picks a request's adapter
from the hidden state of its prompt's last token; when it picks one, the prompt runs again with it."""

from __future__ import annotations

import numpy as np
import structlog

from ruvllm.engine.scheduler import ScheduledChunk, Scheduler

log = structlog.get_logger("ruvllm.engine")


class AdapterRouter:
    """Holds the last-prompt-token hidden states of routed requests until their router is asked."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        #: Hidden states awaiting their request's router, by sequence id.
        self._hidden: dict[int, np.ndarray] = {}

    @staticmethod
    def wants(c: ScheduledChunk) -> bool:
        """The chunk that ends the prompt of a request whose adapter a router picks."""
        st = c.seq.state
        return (
            st.inference.adapter_router is not None
            and st.inference.adapter is None
            and not st.routed
            and c.seq.index == 0
            and c.completes
            and c.start + c.num_tokens == c.seq.num_prompt_tokens
        )

    def hold(self, c: ScheduledChunk, hidden: np.ndarray) -> None:
        """Keep the hidden state of the last token of ``c`` (a chunk :meth:`wants` chose)."""
        self._hidden[c.seq.seq_id] = np.asarray(hidden[-1], np.float32)

    def route(self, chunk: ScheduledChunk) -> bool:
        """Ask the request's router; True when it picked an adapter and the prompt must run again."""
        st = chunk.seq.state
        hidden = self._hidden.pop(chunk.seq.seq_id, None)
        if hidden is None or st.routed:
            return False
        st.routed = True
        try:
            adapter = st.inference.adapter_router(hidden)
        except Exception as exc:  # a plugin's failure leaves the request on the base model
            log.warning("adapter router failed", request_id=st.request.request_id, error=repr(exc))
            return False
        if adapter is None:
            return False
        st.inference.adapter = adapter
        self.scheduler.recompute(chunk.seq)
        return True
