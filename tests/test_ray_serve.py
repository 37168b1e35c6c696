"""Replicas on Ray Serve (issue 19, part 2): a local Ray cluster on this machine runs
``ruvllm_server.ray.build_app`` with two engine replicas of a tiny Llama (tests/_ray_check.py, in a
process of its own so Ray's processes never share the suite's). Through Ray's HTTP proxy:

* the official openai client gets completions and chat completions, whole and streamed, and the
  streamed text equals the whole one (greedy);
* 16 requests over 4 shared 96-token prefixes get more prompt tokens from the prefix caches under the
  prefix-affinity router than under round-robin, and each prefix stays on one replica;
* killing one replica's process while eight streams run: the streams it held end with an error event
  (or a 503 if it had not answered yet), every other stream completes, requests keep being served,
  and Ray's replacement replica serves within the stated bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ruvllm-server[ray]')")

# Starting Ray and its replicas takes about a minute; the run has a limit of its own (900 s), which
# fails the module with Ray's output before the per-test limit would stop the whole session.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).parent / "_ray_check.py"
#: Seconds within which a killed replica's replacement must serve (Ray restarts it; the tiny model
#: loads in a few seconds; the bound leaves room for a loaded 2-core machine).
REPLACED_WITHIN_S = 120
STREAM_TOKENS = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_ray_processes(temp_dir: str) -> None:
    """Whatever of this cluster outlived the script (its processes name the session directory)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmdline:
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_result(tmp_path_factory) -> dict:
    from _jax_fixtures import write_tiny_hf_model
    from _tiny_served_fixtures import write_word_tokenizer

    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny-ray"), "llama")
    write_word_tokenizer(model)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    temp_dir = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray's socket paths must fit
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), str(model), str(free_port()), temp_dir],
            capture_output=True, text=True, env=env, timeout=900,
        )  # fmt: skip
    finally:
        kill_ray_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    print(json.dumps({k: v for k, v in result.items() if k != "kill"}, indent=1))
    print(json.dumps({k: v for k, v in result["kill"].items() if k != "streams"}))
    return result


def test_the_openai_client_streams_and_non_streams_through_rays_proxy(ray_result):
    r = ray_result["openai"]
    assert "tiny" in r["models"]
    assert r["completion"] and r["completion_streamed"] == r["completion"]
    assert r["completion_chunks"] > 1
    assert r["chat"] and r["chat_streamed"] == r["chat"]
    assert r["chat_chunks"] > 1
    assert r["stream_read_whole"].endswith("data: [DONE]\n\n")  # the streamed response ends
    assert r["stream_content_type"] == "text/event-stream; charset=utf-8"


def test_prefix_affinity_serves_more_prompt_tokens_from_cache_than_round_robin(ray_result):
    prefix, rr = ray_result["prefix"], ray_result["round_robin"]
    # Each prefix is computed once when its requests stay on one replica: 3 of 4 requests hit its six
    # blocks (96 tokens). Round-robin splits a prefix's requests over both replicas.
    assert prefix["replicas_per_prefix"] == [1, 1, 1, 1]
    assert prefix["cached_tokens"] == 4 * 3 * 96
    assert rr["cached_tokens"] < prefix["cached_tokens"]
    assert max(rr["replicas_per_prefix"]) == 2


def test_a_killed_replica_fails_only_its_requests_and_is_replaced(ray_result):
    kill = ray_result["kill"]
    victim = kill["victim"]
    on_victim = [s for s in kill["streams"] if s.get("replica") == victim or s.get("status") == 503]
    others = [s for s in kill["streams"] if s not in on_victim]
    assert on_victim and others
    for s in on_victim:  # a clean error, never a hang or a silent truncation
        assert s["error"] is not None or s.get("status") == 503, s
        assert not s["done"], s
    for s in others:
        assert s["done"] and s["error"] is None and s["tokens"] == STREAM_TOKENS, s
    assert kill["served_while_replacing"] >= 1
    assert kill["back_after_s"] is not None and kill["back_after_s"] < REPLACED_WITHIN_S


# --- what build_app deploys (no cluster needed) -------------------------------------------------


def test_plan_autoscaling_bounds_routers_and_refusals():
    from ruvllm_server.ray import RoundRobinRouter, plan_deployment, prefix_router
    from ruvllm_server.settings import ServerConfigError

    plan = plan_deployment({"model": "smollm2", "min_replicas": "1", "max_replicas": "3", "max_concurrent": "8"})
    scaling = plan.engine["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 3) and "num_replicas" not in plan.engine
    assert plan.engine["max_ongoing_requests"] == 8 + 512  # what one replica's server admits and queues
    assert plan.ingress["max_ongoing_requests"] == 3 * (8 + 512)
    assert plan.settings == {"model": "smollm2", "max_concurrent": "8"}  # the replicas' server settings
    router = plan.engine["request_router_config"]
    assert router.request_router_kwargs == {"imbalanced_threshold": 8.0}
    assert router.get_request_router_class() is prefix_router()

    plan = plan_deployment({"model": "smollm2", "replicas": 2, "router": "round_robin"})
    assert plan.engine["num_replicas"] == 2
    assert plan.engine["request_router_config"].get_request_router_class() is RoundRobinRouter
    assert "request_router_config" not in plan_deployment({"model": "smollm2", "router": "pow2"}).engine

    for bad, words in [
        ({"router": "random"}, "router must be one of"),
        ({"replicas": 0}, "at least 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
        ({"replicas": "two"}, "must be numbers"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ]:
        with pytest.raises(ServerConfigError, match=words):
            plan_deployment({"model": "smollm2", **bad})
