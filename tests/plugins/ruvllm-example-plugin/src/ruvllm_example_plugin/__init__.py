"""A third-party plugin: records every request it sees to the JSON-lines file named by
RUVLLM_EXAMPLE_PLUGIN_LOG, adds an ``example-echo`` command and a tool-call parser (``example_call_line``)."""

import json
import os

from ruvllm import hookimpl


def _record(event: dict) -> None:
    path = os.environ.get("RUVLLM_EXAMPLE_PLUGIN_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event) + "\n")


@hookimpl
def pre_inference(request):
    _record({"hook": "pre_inference", "request_id": request.request_id, "prompt_tokens": len(request.prompt_token_ids)})


@hookimpl
def post_inference(request, result):
    _record(
        {
            "hook": "post_inference",
            "request_id": request.request_id,
            "completion_tokens": len(result.output_token_ids),
            "text": result.text,
            "finish_reason": result.finish_reason,
        }
    )


@hookimpl
def register_commands(subparsers):
    p = subparsers.add_parser("example-echo", help="(example plugin) print the words given")
    p.add_argument("words", nargs="*")
    p.set_defaults(func=lambda args, host: print(" ".join(args.words)) or 0)


@hookimpl
def register_tool_parsers(register):
    from ruvllm_server.tools import ParsedOutput, ToolCall, ToolParser

    class CallLineParser(ToolParser):
        """Calls written as ``name({...json arguments...})``, one per line."""

        name = "example_call_line"
        markers = ("(",)

        def parse(self, text, tools):
            names = {t["function"]["name"] for t in tools}
            calls = []
            for line in text.strip().splitlines():
                head, paren, rest = line.partition("(")
                if not paren or head.strip() not in names or not rest.endswith(")"):
                    return ParsedOutput(text, [])
                try:
                    args = json.loads(rest[:-1])
                except ValueError:
                    return ParsedOutput(text, [])
                calls.append(ToolCall(head.strip(), json.dumps(args)))
            return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])

    register(CallLineParser)


@hookimpl
def model_loaded(model, options):
    _record({"hook": "model_loaded", "model": model.name, "options": dict(options.get("example", {}))})


@hookimpl
def register_routes(register, context):
    mine = context.options.get("example", {})
    if mine.get("route") != "on":
        return
    from litestar import Request, get

    @get("/v1/example/hello", sync_to_thread=False)
    def hello(request: Request) -> dict:
        return {"hello": mine.get("name", "world"), "key_id": context.api_key_id(request)}

    register(hello)
