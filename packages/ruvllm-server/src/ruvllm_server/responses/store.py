"""Stored responses: a bounded in-memory map from response id to the response and the conversation
that led to it, least recently used first out, each entry dropped after a time to live."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ruvllm_server.responses.wire import ResponseObject
from ruvllm_server.schemas import ChatMessage

#: Defaults of the store's bounds (``ServerSettings.responses_store_max``, ``responses_store_ttl``).
DEFAULT_MAX_RESPONSES = 1000
DEFAULT_TTL_SECONDS = 3600.0


@dataclass
class StoredResponse:
    response: ResponseObject
    #: The whole conversation, this response's output last: what ``previous_response_id`` continues.
    conversation: list[ChatMessage]
    stored_at: float


class ResponseStore:
    """At most ``max_count`` responses, each for ``ttl`` seconds after it was stored."""

    def __init__(
        self,
        max_count: int = DEFAULT_MAX_RESPONSES,
        ttl: float = DEFAULT_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_count = max_count
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        if self.max_count <= 0:
            return
        self._expire()
        self._entries[response.id] = StoredResponse(response, conversation, self._clock())
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.max_count:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        # Entries are in storing order only until a get moves one: scan them all (the store is small).
        now = self._clock()
        for key in [k for k, e in self._entries.items() if now - e.stored_at > self.ttl]:
            del self._entries[key]
