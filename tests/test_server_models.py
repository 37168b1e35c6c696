"""Several models in one server (``ruvllm_server.pool``): three tiny random checkpoints (different
seeds, a word-level tokenizer and a chat template) loaded when a request names them, the least
recently used unloaded beyond ``models_max`` or ``models_memory``, answers equal to a server holding
that model alone, Ollama's ``keep_alive``, a model that fails to load, the dialects' not-found
errors, the real ``anthropic`` and ``ollama`` clients, and resident memory over 200 alternations."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from _candle_compat_fixtures import write_tiny_hf_checkpoint
from _server_fixtures import live_server
from _tiny_served_fixtures import write_word_tokenizer

from ruvllm_server.pool_config import keep_alive_seconds, model_specs
from ruvllm_server.settings import ServerConfigError, ServerSettings

pytestmark = pytest.mark.timeout(600)

NAMES = ("tiny-a", "tiny-b", "tiny-c")
#: Words only (the tokenizer knows w0..w96): each turn's content, then w1 to start the answer.
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
PROMPT = "w5 w17 w3 w42"
GREEDY = {"max_tokens": 6, "temperature": 0}


def _write(root: Path, name: str, seed: int) -> Path:
    path = root / name
    path.mkdir()
    write_tiny_hf_checkpoint(path, layers=2, hidden=48, vocab=97, max_positions=128, seed=seed, tied=False)
    write_word_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(NAMES):
        _write(root, name, seed)
    return root


def _pool(models_dir: Path | None, /, **settings):
    settings.setdefault("models_dir", None if models_dir is None else str(models_dir))
    settings.setdefault("backend", "candle-compat")
    settings.setdefault("num_kv_blocks", 64)
    settings.setdefault("drain_timeout", 10.0)
    return live_server(None, model="", **settings)


def _complete(base: str, model: str, prompt: str = PROMPT) -> str:
    r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": prompt, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def _chat(base: str, model: str) -> str:
    messages = [{"role": "user", "content": PROMPT}]
    r = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": messages, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def alone(models_dir: Path) -> dict[str, tuple[str, str]]:
    """Each model's greedy completion and chat answer from a server holding it alone."""
    from ruvllm.runtime import load_model

    out = {}
    for name in NAMES:
        model = load_model(str(models_dir / name), backend="candle-compat")
        with live_server(model, model=str(models_dir / name), num_kv_blocks=64) as srv:
            out[name] = (_complete(srv.base_url, name), _chat(srv.base_url, name))
    assert len({a for a, _ in out.values()}) == 3, out  # the seeds give three different models
    return out


def _statuses(base: str) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]}


def test_each_request_runs_on_the_model_it_names_and_the_least_recently_used_unloads(models_dir, alone):
    from prometheus_client.parser import text_string_to_metric_families

    with _pool(models_dir, models_max=2, keep_alive="-1") as srv:
        base = srv.base_url
        assert _statuses(base) == dict.fromkeys(NAMES, "unloaded")  # nothing loads before it is asked for
        order = ["tiny-a", "tiny-b", "tiny-a", "tiny-c", "tiny-b", "tiny-c", "tiny-a"]
        for name in order:
            assert _complete(base, name) == alone[name][0], name
            assert _chat(base, name) == alone[name][1], name
            states = _statuses(base)
            assert states[name] == "loaded"
            assert sum(s == "loaded" for s in states.values()) <= 2, states
        # c came when b was the least recently used, b when a was, a when b was.
        assert _statuses(base) == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "loaded"}
        text = httpx.get(base + "/metrics", timeout=10).text
        families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition, no clashes
        unloads = sum(s.value for s in families["ruvllm_model_unloads"].samples if s.name.endswith("_total"))
        loads = sum(
            s.value for s in families["ruvllm_model_loads"].samples
            if s.name.endswith("_total") and s.labels["outcome"] == "loaded"
        )  # fmt: skip
        assert (loads, unloads) == (5, 3)
        generated = {
            s.labels["model_name"]: s.value
            for s in families["ruvllm_generation_tokens"].samples
            if s.name.endswith("_total")
        }
        assert set(generated) == {"tiny-a", "tiny-c"}  # the loaded models, each its own counts


def test_a_memory_budget_that_fits_two_models(models_dir, alone):
    with _pool(models_dir, models_max=3, keep_alive="-1") as srv:
        _complete(srv.base_url, "tiny-a")
        charge = srv.state.entries["tiny-a"].charge
    assert charge > 0
    budget = int(2.5 * charge)  # two fit, three do not
    with _pool(models_dir, models_max=3, keep_alive="-1", models_memory=budget) as srv:
        for i, name in enumerate([*NAMES, *NAMES]):
            assert _complete(srv.base_url, name) == alone[name][0]
            assert sum(s == "loaded" for s in _statuses(srv.base_url).values()) == min(2, i + 1)
        held = sum(e.charge for e in srv.state.entries.values() if e.status == "loaded")
        assert held <= budget


def test_resident_memory_does_not_grow_over_200_alternations(models_dir, alone):
    proc = psutil.Process()
    with _pool(models_dir, models_max=2, keep_alive="-1") as srv:
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:

            def one(i: int) -> None:
                name = NAMES[i % 3]  # with room for two, every request loads its model
                r = client.post("/v1/completions", json={"model": name, "prompt": PROMPT, **GREEDY})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[name][0]

            for i in range(40):  # warm: allocator pools, imports, compiled regexes
                one(i)
            before = proc.memory_info().rss
            for i in range(40, 240):
                one(i)
            after = proc.memory_info().rss
        loads = srv.state.metrics.loads.labels("tiny-a", "loaded")
    assert loads._value.get() == 80  # every third request of 240 loaded tiny-a
    assert after - before < 24 * 2**20, (before, after)


def test_unknown_models_get_each_dialects_not_found(models_dir):
    with _pool(models_dir) as srv:
        oai = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            oai.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as a:
            claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": PROMPT}])
        assert a.value.body["type"] == "error" and "nope" in a.value.body["error"]["message"]
        with pytest.raises(ollama.ResponseError) as o:
            ollama.Client(host=srv.base_url).chat(model="nope", messages=[{"role": "user", "content": PROMPT}])
        assert o.value.status_code == 404 and "nope" in o.value.error
        # A model field of the wrong type: the dialect's 400 before anything loads.
        r = httpx.post(srv.url("/v1/messages"), json={"model": 5, "max_tokens": 4, "messages": []})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = httpx.post(srv.url("/v1/completions"), content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        assert _statuses(srv.base_url) == dict.fromkeys(NAMES, "unloaded")
        # Past the model's pick, each dialect's own checks, in its own shape: a missing required field,
        # a tool_result that answers no tool_use, an Ollama option of the wrong type.
        r = httpx.post(srv.url("/v1/messages"), json={"model": "tiny-a", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "3"}]}]
        r = httpx.post(srv.url("/v1/messages"), json={"model": "tiny-a", "max_tokens": 4, "messages": orphan})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        r = httpx.post(srv.url("/api/generate"), json={"model": "tiny-b", "prompt": PROMPT, "options": {"top_k": "x"}})
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
        assert _complete(srv.base_url, "tiny-c")  # and the server keeps serving
        assert all(e.users == 0 for e in srv.state.entries.values())  # no request kept a model


def test_the_clients_of_each_dialect_reach_the_model_they_name(models_dir, alone):
    with _pool(models_dir, models_max=2) as srv:
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0)
        client = ollama.Client(host=srv.base_url)
        vectors_of: dict[str, list] = {}
        for name in ("tiny-a", "tiny-b"):
            # (the SDK takes no sampling fields any more: they go as extra_body)
            msg = claude.messages.create(
                model=name, max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": PROMPT}]
            )
            assert msg.model == name and msg.content[0].text == alone[name][1]
            with claude.messages.stream(
                model=name, max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": PROMPT}]
            ) as stream:
                assert "".join(stream.text_stream) == alone[name][1]
            chat = client.chat(model=f"{name}:latest", messages=[{"role": "user", "content": PROMPT}],
                               options={"temperature": 0, "num_predict": 6})  # fmt: skip
            assert chat.message.content == alone[name][1]
            parts = client.generate(model=name, prompt=PROMPT, raw=True, stream=True,
                                    options={"temperature": 0, "num_predict": 6})  # fmt: skip
            assert "".join(p.response for p in parts) == alone[name][0]
            assert client.show(name).details.family == "llama"
            vectors = client.embed(model=name, input=[PROMPT, "w9 w8"]).embeddings
            r = httpx.post(srv.url("/v1/embeddings"), json={"model": name, "input": [PROMPT, "w9 w8"]})
            assert vectors == [d["embedding"] for d in r.json()["data"]]
            vectors_of[name] = vectors
        listed = {m.model for m in client.list().models}
        assert listed == {f"{n}:latest" for n in NAMES}  # unloaded ones too, read from their files
        running = {m.model for m in client.ps().models}
        assert running == {"tiny-a:latest", "tiny-b:latest"}
        assert vectors_of["tiny-a"] != vectors_of["tiny-b"]  # each model embeds with its own weights


def test_keep_alive_as_ollama_reads_it(models_dir):
    with _pool(models_dir, keep_alive="5m") as srv:
        client = ollama.Client(host=srv.base_url)
        opts = {"temperature": 0, "num_predict": 3}
        client.generate(model="tiny-a", prompt=PROMPT, options=opts)
        (ps,) = client.ps().models
        assert ps.expires_at is not None  # five minutes from now
        left = ps.expires_at.timestamp() - time.time()
        assert 200 < left <= 301, left
        client.generate(model="tiny-a", prompt=PROMPT, options=opts, keep_alive=-1)
        assert client.ps().models[0].expires_at is None
        client.generate(model="tiny-a", prompt=PROMPT, options=opts, keep_alive=0)
        _until(lambda: _statuses(srv.base_url)["tiny-a"] == "unloaded")
        client.generate(model="tiny-b", prompt=PROMPT, options=opts, keep_alive="1s")
        assert _statuses(srv.base_url)["tiny-b"] == "loaded"
        _until(lambda: _statuses(srv.base_url)["tiny-b"] == "unloaded", timeout=10)
        # Ollama's load and unload requests: no prompt.
        assert client.generate(model="tiny-c").done_reason == "load"
        assert _statuses(srv.base_url)["tiny-c"] == "loaded"
        assert client.generate(model="tiny-c", keep_alive=0).done_reason == "unload"
        assert _statuses(srv.base_url)["tiny-c"] == "unloaded"
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(model="tiny-c", prompt=PROMPT, keep_alive="soon")
        assert e.value.status_code == 400


def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_model_that_fails_to_load_fails_its_requests_and_leaves_the_others(models_dir, tmp_path, alone):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)  # a header and nothing it promises
    config = tmp_path / "models.toml"
    config.write_text(
        f'[models.broken]\nmodel = "{broken}"\n\n[models.tiny-a]\naliases = ["first", "a"]\nkeep_alive = "-1"\n'
    )
    with _pool(models_dir, models_config=str(config)) as srv:
        r = httpx.post(srv.url("/v1/completions"), json={"model": "broken", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 500 and "failed to load" in r.json()["error"]["message"], r.text
        card = next(m for m in httpx.get(srv.url("/v1/models")).json()["data"] if m["id"] == "broken")
        assert card["status"] == "failed" and card["error"]
        assert _complete(srv.base_url, "tiny-b") == alone["tiny-b"][0]  # the others keep serving
        r = httpx.post(srv.url("/v1/completions"), json={"model": "a", "prompt": PROMPT, **GREEDY})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone["tiny-a"][0]
        assert httpx.get(srv.url("/v1/models/first")).json()["id"] == "tiny-a"
        assert httpx.get(srv.url("/ready")).status_code == 200  # /ready is about the server


def test_a_dropped_stream_gives_its_model_back(models_dir):
    with _pool(models_dir, keep_alive="-1") as srv:
        body = {"model": "tiny-a", "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        entry = srv.state.entries["tiny-a"]
        _until(lambda: entry.users == 0)
        r = httpx.post(srv.url("/models/unload"), json={"model": "tiny-a"})
        assert r.status_code == 200 and r.json()["status"] == "unloaded"
        r = httpx.post(srv.url("/models/load"), json={"model": "tiny-b"})
        assert r.status_code == 200 and r.json()["status"] == "loaded"


def test_settings_of_several_models(tmp_path, models_dir):
    config = tmp_path / "models.toml"
    config.write_text('[models.tiny-a]\nquantization = "none"\nmax_context = 64\nkeep_alive = "90s"\n')
    specs = {s.name: s for s in model_specs(ServerSettings(models_dir=str(models_dir), models_config=str(config)))}
    assert list(specs) == list(NAMES)
    assert specs["tiny-a"].settings.max_context == 64 and specs["tiny-a"].keep_alive == 90
    assert specs["tiny-b"].settings.max_context is None and specs["tiny-b"].keep_alive == 300
    assert specs["tiny-a"].settings.model_name == "tiny-a"
    bad = {
        "[models.tiny-a]\nport = 9\n": "'port' cannot be set per model",
        '[models.tiny-a]\naliases = ["tiny-b"]\n': "already a name",
        '[models.ghost]\nquantization = "none"\n': "gives no `model`",
        "port = 9\n": "[models.NAME]",
    }
    for text, message in bad.items():
        config.write_text(text)
        with pytest.raises(ServerConfigError, match=re.escape(message)):
            model_specs(ServerSettings(models_dir=str(models_dir), models_config=str(config)))
    with pytest.raises(ServerConfigError, match="served_model_name"):
        model_specs(ServerSettings(models=["a.gguf", "b.gguf"], served_model_name="x"))
    assert [keep_alive_seconds(v) for v in ("5m", "1h30m", 10, "0", "-1", "300ms")] == [300, 5400, 10, 0, None, 0.3]
    with pytest.raises(ServerConfigError, match="duration"):
        keep_alive_seconds("5 minutes")


def test_a_tool_round_trip_and_token_counts_on_the_model_named(models_dir, smollm2_path, tmp_path):
    """The ``anthropic`` SDK against SmolLM2 (which writes tool calls) and a tiny model in one server:
    a forced tool call, its result sent back, and ``count_tokens`` counted by each model's own
    tokenizer and template, equal to what a server holding SmolLM2 alone counts."""
    from ruvllm.runtime import load_model

    weather = {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False},
    }  # fmt: skip
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    config = tmp_path / "models.toml"
    tiny_a = models_dir / "tiny-a"
    config.write_text(f'[models.smollm2]\nmodel = "{smollm2_path}"\n\n[models.tiny-a]\nmodel = "{tiny_a}"\n')
    with live_server(load_model(str(smollm2_path), backend="candle-compat")) as alone:
        one = anthropic.Anthropic(base_url=alone.base_url, api_key="unused", max_retries=0)
        counted_alone = one.messages.count_tokens(model="smollm2", messages=ask, tools=[weather]).input_tokens
    with _pool(None, models_config=str(config), models_max=2) as srv:
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        m = claude.messages.create(
            model="smollm2", max_tokens=40, messages=ask, tools=[weather], extra_body={"temperature": 0},
            tool_choice={"type": "tool", "name": "get_weather"},
        )  # fmt: skip
        assert m.stop_reason == "tool_use"
        (call,) = [b for b in m.content if b.type == "tool_use"]
        assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
        followup = [
            *ask,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
        ]
        answer = claude.messages.create(model="smollm2", max_tokens=8, messages=followup, tools=[weather],
                                        tool_choice={"type": "none"}, extra_body={"temperature": 0})  # fmt: skip
        assert [b.type for b in answer.content] == ["text"]
        counted = claude.messages.count_tokens(model="smollm2", messages=ask, tools=[weather]).input_tokens
        assert counted == counted_alone
        tiny = claude.messages.count_tokens(model="tiny-a", messages=[{"role": "user", "content": PROMPT}])
        assert tiny.input_tokens == len(PROMPT.split()) + 1  # its template: the words, then w1
