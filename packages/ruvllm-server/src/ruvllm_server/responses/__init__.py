"""``/v1/responses``, the OpenAI Responses API, served through the chat path: wire types
(:mod:`.wire`), the translation both ways (:mod:`.translate`), the event stream (:mod:`.events`),
stored responses (:mod:`.store`) and the handlers (:mod:`.routes`)."""

from ruvllm_server.responses.routes import RESPONSES_ROUTES
from ruvllm_server.responses.store import ResponseStore

__all__ = ["RESPONSES_ROUTES", "ResponseStore"]
