"""The server on the mlx backend (SmolLM2, the file's blocks, MLX's CPU build): a chat completion,
the same text streamed, a forced tool call whose arguments validate, a json_schema answer; 16
concurrent greedy streams give the text each gives alone; and ``ruvllm serve --backend mlx`` where MLX
cannot be imported is a one-line error, no server started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from _server_fixtures import live_server

pytest.importorskip("mlx.core")

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def mlx_smollm2(smollm2_path):
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    model = load_model(str(smollm2_path), backend="mlx", options=LoadOptions(quantization="auto"))
    assert model.model.options.quantization == "gguf"
    return model


@pytest.fixture(scope="module")
def client(mlx_smollm2):
    with live_server(mlx_smollm2, num_kv_blocks=256) as srv:
        yield openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def _chat(client, content: str, max_tokens: int = 8) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content


def _streamed(client, content: str, max_tokens: int = 8) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_chat_and_the_same_text_streamed(client):
    whole = _chat(client, "What is the capital of France?")
    assert whole and whole == _streamed(client, "What is the capital of France?")


@pytest.mark.slow  # the tools' template makes a prompt of hundreds of tokens: ~40 s of MLX's CPU prefill
def test_a_forced_tool_call(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_json_schema_answer(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city in France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        temperature=0,
        max_tokens=30,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.slow
def test_sixteen_concurrent_greedy_streams_give_each_ones_text_alone(client):
    prompts = [f"Count from {i} to {i + 3}." for i in range(16)]
    alone = [_streamed(client, p, 6) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _streamed(client, p, 6), prompts))
    assert together == alone


def test_serve_without_mlx_is_a_one_line_error(smollm2_path, tmp_path):
    blocked = tmp_path / "blocked" / "mlx"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('No module named mlx (hidden by the test)')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "blocked")}
    proc = subprocess.run(
        [sys.executable, "-m", "ruvllm", "serve", str(smollm2_path), "--backend", "mlx", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "mlx" in line]
    assert errors and "cannot run on this machine: MLX is not installed" in errors[-1], proc.stderr
    assert "Uvicorn running" not in proc.stderr


def test_the_device_flag_reaches_the_backend(smollm2_path):
    """``--device`` (ServerSettings.device) becomes the backend's ``device`` option: mlx runs on the
    CPU it names; a backend without the choice (jax) refuses it by name before anything loads."""
    import mlx.core as mx

    from ruvllm.errors import BackendError
    from ruvllm_server.settings import ServerSettings
    from ruvllm_server.state import load_model

    loaded = load_model(ServerSettings(model=str(smollm2_path), backend="mlx", device="cpu", quantization="q8"))
    assert loaded.model.device == mx.Device(mx.cpu)
    with pytest.raises(BackendError, match=r"unknown option.*device"):
        load_model(ServerSettings(model=str(smollm2_path), backend="jax", device="cpu"))
