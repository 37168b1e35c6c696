"""The ``/v1/messages`` handlers: create (plain or streamed) and count_tokens. Thin: the request is
translated to a chat request once, run by the chat path, and its answer translated back."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, Response, post
from litestar.params import Body
from litestar.response import Stream

from ruvllm.errors import RequestError
from ruvllm_server.anthropic.events import MessageEvents, message_events
from ruvllm_server.anthropic.translate import chat_request, message, new_id, renamed
from ruvllm_server.anthropic.wire import CountTokensRequest, Message, MessagesRequest, TokenCount
from ruvllm_server.errors import APIError
from ruvllm_server.generation import ChatJob, cancel_on_disconnect, check_model
from ruvllm_server.generation.sse import SSE_HEADERS
from ruvllm_server.request_context import request_user, served_state, track_stream
from ruvllm_server.state import ServerState


def _state(request: Request) -> ServerState:
    return served_state(request)


@post("/v1/messages", status_code=200, summary="Create a message (the Anthropic Messages API)", tags=["anthropic"])
async def create_message(
    request: Request, data: Annotated[MessagesRequest, Body()]
) -> Message | Stream | Response[bytes]:
    translated = chat_request(data)
    job = ChatJob(_state(request), translated.chat, request_user(request))
    msg_id = new_id("msg")
    try:
        run = job.prepare()
        if data.stream:
            await run.compile_constraint()  # a bad schema is a 400, not an error event in the stream
    except (APIError, RequestError) as exc:
        raise renamed(exc, translated.origin) from None
    if data.stream:
        events = MessageEvents(translated, msg_id, len(run.requests[0].prompt_token_ids))
        stream = message_events(job.stream(run), events, lambda: job.stop_reasons.get(0))
        return Stream(track_stream(request, stream), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        completion = await cancel_on_disconnect(request.receive, lambda: job.complete(run))
    except (APIError, RequestError) as exc:
        raise renamed(exc, translated.origin) from None
    if completion is None:
        return Response(b"", status_code=499)
    return message(completion, translated, job.stop_reasons.get(0), msg_id)


@post("/v1/messages/count_tokens", status_code=200, summary="Count a message's input tokens", tags=["anthropic"])
async def count_tokens(request: Request, data: Annotated[CountTokensRequest, Body()]) -> TokenCount:
    translated = chat_request(data)
    job = ChatJob(_state(request), translated.chat, request_user(request))
    try:
        check_model(job.state, translated.chat.model)
        prompt, _ = job.render()
    except (APIError, RequestError) as exc:
        raise renamed(exc, translated.origin) from None
    return TokenCount(len(prompt))


#: The handlers the app registers.
ANTHROPIC_ROUTES = [create_message, count_tokens]
