"""Server settings precedence (flags > RUVLLM_* > TOML > defaults), secret masking, bad values, and
the rate limiter and admission controller on their own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ruvllm_server.limits import AdmissionController, Overloaded, TokenBucketLimiter
from ruvllm_server.settings import ServerConfigError, ServerSettings, load_settings


def test_defaults_without_sources() -> None:
    s = load_settings(environ={})
    assert s == ServerSettings()
    assert s.host == "127.0.0.1" and s.port == 8000 and s.api_keys == []


def test_flags_beat_env_beat_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text(
        'port = 7000\nhost = "0.0.0.0"\nmax_queue = 3\napi_key = "from-toml"\ncors-origins = ["https://a"]\n'
    )
    env = {"RUVLLM_PORT": "7100", "RUVLLM_MAX_QUEUE": "5", "RUVLLM_API_KEY": "k1,k2", "UNRELATED": "x"}
    s = load_settings({"port": 7200, "host": None}, config_file=cfg, environ=env)
    assert s.port == 7200  # flag
    assert s.max_queue == 5  # environment over TOML
    assert s.api_keys == ["k1", "k2"]  # comma list in the environment
    assert s.host == "0.0.0.0"  # an unset flag (None) leaves TOML's value
    assert s.cors_origins == ["https://a"]


def test_dtype_from_flag_env_and_default() -> None:
    assert load_settings(environ={}).dtype == "auto"
    assert load_settings(environ={"RUVLLM_DTYPE": "bfloat16"}).dtype == "bfloat16"
    assert load_settings({"dtype": "float16"}, environ={"RUVLLM_DTYPE": "bfloat16"}).dtype == "float16"


def test_kv_cache_options_from_the_settings() -> None:
    from ruvllm_server.state import kv_cache_options

    assert kv_cache_options(load_settings(environ={})) == {}
    s = load_settings({"kv_cache_dtype": "bfloat16", "kv_cache_quantization": "int8"}, environ={})
    assert kv_cache_options(s) == {"quantization": "int8", "dtype": "bfloat16"}


def test_the_kv_budget_from_device_memory() -> None:
    """``gpu_memory_utilization``: the KV cache gets that fraction of what the device reports, less
    what is in use (the weights); nothing left is a one-line error."""
    from ruvllm_server.state import device_kv_budget

    assert device_kv_budget(0.9, 80 * 10**9, 2 * 10**9) == 70 * 10**9
    assert device_kv_budget(1.0, 1000, 999) == 1
    with pytest.raises(ServerConfigError, match="leave nothing for the KV cache beside the 900"):
        device_kv_budget(0.5, 1000, 900)


def test_the_kv_budget_on_a_cpu_backend(tmp_path: Path) -> None:
    """On backends that report no device memory (candle-compat; jax on a CPU) the host default
    applies, and ``gpu_memory_utilization`` is refused by name; with ``kv_cache_memory`` too, as well."""
    from _jax_fixtures import write_tiny_hf_model

    from ruvllm.runtime import load_model
    from ruvllm_server.state import kv_cache_budget, kv_memory_budget

    path = write_tiny_hf_model(tmp_path, "llama")
    for backend in ("candle-compat", "jax"):
        model = load_model(str(path), backend=backend)
        assert kv_memory_budget(load_settings(environ={}), model) is None  # the engine's default rule
        assert kv_cache_budget(None) is None
        assert kv_memory_budget(load_settings({"kv_cache_memory": "64MiB"}, environ={}), model) == 64 * 2**20
        with pytest.raises(ServerConfigError, match=f"the {backend} backend reports none here"):
            kv_memory_budget(load_settings({"gpu_memory_utilization": 0.5}, environ={}), model)
        both = load_settings({"gpu_memory_utilization": 0.5, "kv_cache_memory": "1GiB"}, environ={})
        with pytest.raises(ServerConfigError, match="not both"):
            kv_memory_budget(both, model)


def test_toml_server_table(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nrate_limit = 2.5\nenable_prefix_caching = false\n")
    s = load_settings(config_file=cfg, environ={})
    assert s.rate_limit == 2.5 and s.enable_prefix_caching is False


def test_env_strings_convert_to_field_types() -> None:
    s = load_settings(environ={"RUVLLM_RATE_LIMIT": "0.5", "RUVLLM_ENABLE_PREFIX_CACHING": "false", "RUVLLM_PORT": "9"})
    assert s.rate_limit == 0.5 and s.enable_prefix_caching is False and s.port == 9
    assert ServerSettings().max_step_ratio == 3.0
    assert load_settings(environ={"RUVLLM_MAX_STEP_RATIO": "2.5"}).max_step_ratio == 2.5


def test_masked_hides_keys() -> None:
    s = load_settings({"api_keys": ["sk-secret-1"]}, environ={})
    shown = s.masked()
    assert "sk-secret-1" not in repr(shown)
    assert shown["api_keys"] == ["***"]


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"port": 70000}, {}, "port"),
        ({"max_concurrent": 0}, {}, "max_concurrent"),
        ({}, {"RUVLLM_PORT": "eighty"}, "port"),
        ({"rate_limit": -1.0}, {}, "rate_limit"),
        ({"max_step_ratio": 0.5}, {}, "max_step_ratio must be 0 \\(off\\) or above 1"),
        ({}, {"RUVLLM_MAX_STEP_RATIO": "-2"}, "max_step_ratio"),
        ({"dtype": "float64"}, {}, "dtype"),
        ({"kv_cache_dtype": "int8"}, {}, "kv_cache_dtype"),
        ({"gpu_memory_utilization": 0.0}, {}, "gpu_memory_utilization"),
        ({}, {"RUVLLM_GPU_MEMORY_UTILIZATION": "1.5"}, "gpu_memory_utilization"),
        ({}, {"RUVLLM_DTYPE": "fp8"}, "dtype"),
    ],
)
def test_bad_values_name_the_setting(flags: dict, env: dict, needle: str) -> None:
    with pytest.raises(ServerConfigError, match=needle):
        load_settings(flags, environ=env)


def test_unknown_toml_key_and_bad_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("prot = 1\n")
    with pytest.raises(ServerConfigError, match="unknown setting 'prot'"):
        load_settings(config_file=cfg, environ={})
    cfg.write_text("port = \n")
    with pytest.raises(ServerConfigError, match="not valid TOML"):
        load_settings(config_file=cfg, environ={})
    with pytest.raises(ServerConfigError, match="not found"):
        load_settings(config_file=tmp_path / "missing.toml", environ={})


def test_model_name_from_reference(tmp_path: Path) -> None:
    assert ServerSettings(model="smollm2").model_name == "smollm2"
    assert ServerSettings(model="/models/SmolLM2.Q4_1.gguf").model_name == "SmolLM2.Q4_1"
    assert ServerSettings(model="org/name").model_name == "org/name"
    assert ServerSettings(model="x", served_model_name="mine").model_name == "mine"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_bursts_refills_and_separates_keys() -> None:
    clock = FakeClock()
    limiter = TokenBucketLimiter(2.0, burst=3, clock=clock)
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.acquire("a")
    assert wait == pytest.approx(0.5)  # one token at 2/s
    assert limiter.acquire("b") == 0.0  # another key has its own bucket
    clock.now += 0.5
    assert limiter.acquire("a") == 0.0
    assert limiter.acquire("a") > 0.0


def test_token_bucket_forgets_oldest_keys() -> None:
    limiter = TokenBucketLimiter(1.0, burst=1, max_keys=2, clock=FakeClock())
    limiter.acquire("a")
    limiter.acquire("b")
    limiter.acquire("c")  # evicts "a"
    assert limiter.acquire("a") == 0.0  # a fresh bucket
    assert limiter.acquire("c") > 0.0


def test_admission_queue_and_overload() -> None:
    async def scenario() -> list[str]:
        adm = AdmissionController(max_concurrent=1, max_queue=1)
        events: list[str] = []
        release_first = asyncio.Event()

        async def first() -> None:
            async with adm.slot():
                events.append("first in")
                await release_first.wait()
            events.append("first out")

        async def second() -> None:
            async with adm.slot():
                events.append("second in")

        t1 = asyncio.create_task(first())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(second())
        await asyncio.sleep(0)
        assert adm.running == 1 and adm.queued == 1
        with pytest.raises(Overloaded):
            async with adm.slot():
                pass
        release_first.set()
        await asyncio.gather(t1, t2)
        assert adm.running == 0 and adm.queued == 0
        return events

    assert asyncio.run(scenario()) == ["first in", "first out", "second in"]


def test_admission_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        adm = AdmissionController(max_concurrent=1, max_queue=4)
        hold = asyncio.Event()

        async def holder() -> None:
            async with adm.slot():
                await hold.wait()

        async def waiter() -> None:
            async with adm.slot():
                pass

        t1 = asyncio.create_task(holder())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        assert adm.queued == 1
        t2.cancel()
        await asyncio.gather(t2, return_exceptions=True)
        assert adm.queued == 0
        hold.set()
        await t1
        assert adm.running == 0

    asyncio.run(scenario())
