"""The ``/v1/responses`` handlers: create (plain or streamed), retrieve, delete. Thin: the request
is translated to a chat request once, run by the chat path, and its answer translated back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from litestar import Request, Response, delete, get, post
from litestar.params import Body, Parameter
from litestar.response import Stream

from ruvllm.errors import RequestError
from ruvllm_server.errors import APIError, bad_request
from ruvllm_server.generation import ChatJob, cancel_on_disconnect
from ruvllm_server.generation.sse import SSE_HEADERS
from ruvllm_server.request_context import request_user, served_state, track_stream
from ruvllm_server.responses.events import ResponseEvents, response_events
from ruvllm_server.responses.store import ResponseStore
from ruvllm_server.responses.translate import (
    Answer,
    ResponseShell,
    Translated,
    chat_request,
    output_messages,
    renamed,
)
from ruvllm_server.responses.wire import DeletedResponse, ResponseObject, ResponseRequest
from ruvllm_server.schemas import ChatCompletion
from ruvllm_server.state import ServerState


def _state(request: Request) -> ServerState:
    return served_state(request)


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use with the settings' bounds."""
    app_state = request.app.state
    store = app_state.get("ruvllm_responses")
    if store is None:
        settings = _state(request).settings
        store = app_state["ruvllm_responses"] = ResponseStore(
            settings.responses_store_max, settings.responses_store_ttl
        )
    return store


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param="response_id", code="not_found")


def _answer(completion: ChatCompletion) -> Answer:
    choice = completion.choices[0]
    m = choice.message
    calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    return Answer(m.content, calls, m.reasoning_content, choice.finish_reason, completion.usage)


def _keep(store: ResponseStore, req: ResponseRequest, translated: Translated, response: ResponseObject) -> None:
    if req.store is not False:
        store.put(response, [*translated.history, *output_messages(response.output)])


@post("/v1/responses", status_code=200, summary="Create a response (the OpenAI Responses API)", tags=["openai"])
async def create_response(
    request: Request, data: Annotated[ResponseRequest, Body()]
) -> ResponseObject | Stream | Response[bytes]:
    state = _state(request)
    store = response_store(request)
    earlier = []
    if data.previous_response_id is not None:
        previous = store.get(data.previous_response_id)
        if previous is None:
            # As OpenAI answers it: a 400 naming the field (the id may have been stored elsewhere).
            raise bad_request(
                f"Previous response with id {data.previous_response_id!r} not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        earlier = previous.conversation
    translated = chat_request(data, state.model_name, earlier)
    job = ChatJob(state, translated.chat, request_user(request))
    try:
        run = job.prepare()
        if data.stream:
            await run.compile_constraint()
    except (APIError, RequestError) as exc:
        raise renamed(exc) from None
    shell = ResponseShell(data, state.model_name)
    if data.stream:
        return Stream(
            track_stream(request, _stream(store, data, translated, shell, job.stream(run))),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        completion = await cancel_on_disconnect(request.receive, lambda: job.complete(run))
    except (APIError, RequestError) as exc:
        raise renamed(exc) from None  # a schema the grammar compiler rejects comes from the run
    if completion is None:
        return Response(b"", status_code=499)
    response = shell.finish(_answer(completion))
    _keep(store, data, translated, response)
    return response


async def _stream(
    store: ResponseStore,
    req: ResponseRequest,
    translated: Translated,
    shell: ResponseShell,
    chat_stream: AsyncIterator[bytes],
) -> AsyncIterator[bytes]:
    try:
        async for event, finished in response_events(chat_stream, ResponseEvents(shell)):
            if finished is not None:
                _keep(store, req, translated, finished)  # before the last event: a client may ask at once
            yield event
    finally:
        await chat_stream.aclose()  # type: ignore[attr-defined]


@get("/v1/responses/{response_id:str}", summary="Retrieve a stored response", tags=["openai"])
async def retrieve_response(request: Request, response_id: Annotated[str, Parameter()]) -> ResponseObject:
    entry = response_store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


@delete("/v1/responses/{response_id:str}", status_code=200, summary="Delete a stored response", tags=["openai"])
async def delete_response(request: Request, response_id: Annotated[str, Parameter()]) -> DeletedResponse:
    if not response_store(request).delete(response_id):
        raise _not_found(response_id)
    return DeletedResponse(response_id)


#: The handlers the app registers.
RESPONSES_ROUTES = [create_response, retrieve_response, delete_response]
