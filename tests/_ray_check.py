"""Run by test_ray_serve.py in a process of its own: a local Ray cluster on this machine, the server's
Ray Serve application (``ruvllm_server.ray.build_app``) with two engine replicas of the tiny model,
and the scenario the test checks. Prints one line ``RESULT {json}``.

Usage: ``_ray_check.py MODEL_DIR HTTP_PORT TEMP_DIR``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import ray
from ray import serve

from ruvllm_server.ray import REPLICA_HEADER, build_app

MODEL, PORT, TEMP_DIR = sys.argv[1], int(sys.argv[2]), sys.argv[3]
BASE = f"http://127.0.0.1:{PORT}"
#: Four prompts of 96 tokens (six full KV blocks of 16) that requests share as prefixes.
PREFIXES = [" ".join(f"w{(7 * p + 3 * i) % 90 + 5}" for i in range(96)) for p in range(4)]


def deploy(router: str, *, cli: bool = False) -> None:
    """Two replicas of the tiny model behind ``router``; ``cli``: with docs/scaling.md's command,
    ``serve run ruvllm_server.ray:build_app key=value ...``, against this script's cluster."""
    settings = {
        "model": MODEL,
        "backend": "jax",
        "quantization": "none",
        "served_model_name": "tiny",
        "precompile": False,
        "threads": 1,
        "kv_cache_memory": "32MiB",
        "max_num_seqs": 8,
    }
    args = {**settings, "replicas": 2, "router": router}
    if not cli:
        serve.run(build_app(args), name="ruvllm", route_prefix="/")
        return
    address = ray.get_runtime_context().gcs_address
    command = [str(Path(sys.executable).with_name("serve")), "run", "--address", address, "--non-blocking",
               "--name", "ruvllm", "--route-prefix", "/", "ruvllm_server.ray:build_app",
               *(f"{k}={v}" for k, v in args.items())]  # fmt: skip
    subprocess.run(command, check=True, timeout=300, capture_output=True)
    deadline = time.monotonic() + 300
    while serve.status().applications["ruvllm"].status != "RUNNING":
        if time.monotonic() > deadline:
            raise TimeoutError(f"serve run: {serve.status().applications['ruvllm']}")
        time.sleep(0.5)


def replica_of(headers: httpx.Headers) -> str:
    return headers[REPLICA_HEADER]


def shared_prefix_run() -> dict:
    """16 completions over 4 shared prefixes, in a fixed shuffled order, one at a time: the prompt
    tokens the replicas' prefix caches served, and which replica answered each prefix."""
    order = [p for p in range(4) for _ in range(4)]
    random.Random(7).shuffle(order)
    cached, replicas = 0, {p: set() for p in range(4)}
    with httpx.Client(base_url=BASE, timeout=120) as client:
        for i, p in enumerate(order):
            body = {"model": "tiny", "prompt": f"{PREFIXES[p]} w{i + 1} w{i + 2}", "max_tokens": 1, "temperature": 0}
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            replicas[p].add(replica_of(r.headers))
    return {"cached_tokens": cached, "replicas_per_prefix": [len(replicas[p]) for p in range(4)]}


def openai_client_run() -> dict:
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.completions.create(model="tiny", prompt="w5 w6 w7 w8", max_tokens=8, temperature=0)
    streamed = client.completions.create(model="tiny", prompt="w5 w6 w7 w8", max_tokens=8, temperature=0, stream=True)
    chunks = [c.choices[0].text for c in streamed if c.choices]
    messages = [{"role": "user", "content": "w9 w10 w11"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    chat_stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chat_chunks = [c.choices[0].delta.content or "" for c in chat_stream if c.choices]
    models = [m.id for m in client.models.list().data]
    # A streamed answer read whole: the response must end after [DONE] (not just stop sending).
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 3, "stream": True}
    whole_stream = httpx.post(f"{BASE}/v1/completions", json=body, timeout=30)
    return {
        "completion": whole.choices[0].text,
        "completion_streamed": "".join(chunks),
        "completion_chunks": len(chunks),
        "chat": chat.choices[0].message.content,
        "chat_streamed": "".join(chat_chunks),
        "chat_chunks": len(chat_chunks),
        "models": models,
        "stream_read_whole": whole_stream.text[-40:],
        "stream_content_type": whole_stream.headers["content-type"],
    }


def stream_one(i: int, started: dict) -> dict:
    """One long streamed completion; records its replica as soon as the headers arrive."""
    body = {"model": "tiny", "prompt": f"w{i + 5} w{i + 6}", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    out = {"i": i, "tokens": 0, "error": None, "done": False}
    try:
        with (
            httpx.Client(base_url=BASE, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            out["status"] = r.status_code
            out["replica"] = r.headers.get(REPLICA_HEADER)
            started[i] = out["replica"]
            for line in r.iter_lines():
                out["last"] = line[:200]
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"]
                    break
                if event.get("choices") and event["choices"][0].get("text"):
                    out["tokens"] += 1
    except httpx.HTTPError as exc:
        out["error"] = {"transport": f"{type(exc).__name__}: {exc}"}
    return out


def kill_run() -> dict:
    """Eight streams; once both replicas hold some, one replica's process is killed. Then: how the
    streams ended, and how long until the deployment answers from two live replicas again."""
    started: dict[int, str] = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream_one, i, started) for i in range(8)]
        deadline = time.monotonic() + 60
        while len(set(started.values())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = sorted(set(started.values()))[0]
        pid = int(victim.rsplit(":", 1)[1])
        time.sleep(0.2)  # the streams are under way
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        streams = [f.result() for f in futures]
    # Until a fresh replica replaces the dead one: requests keep being served meanwhile.
    served_meanwhile, replicas_seen, back_after = 0, set(), None
    with httpx.Client(base_url=BASE, timeout=60) as client:
        for k in itertools.count():
            if time.monotonic() - killed_at > 180:
                break
            # Prompts whose text shares (almost) nothing with what the replicas served: the prefix
            # router then sends them to the replica holding the least text, the new one. (The words
            # are unknown to the tiny tokenizer and read as its unknown token.)
            prompt = f"{random.Random(k).getrandbits(128):032x} w5 w6"
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            if r.status_code == 200:
                served_meanwhile += 1
                replicas_seen.add(replica_of(r.headers))
            status = serve.status().applications["ruvllm"].deployments["RuvllmEngine"]
            running = sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING"))
            fresh = {rep for rep in replicas_seen if rep != victim and not rep.endswith(f":{pid}")}
            if running == 2 and len(fresh) == 2:
                back_after = time.monotonic() - killed_at
                break
            time.sleep(0.2)
    return {
        "victim": victim,
        "streams": streams,
        "served_while_replacing": served_meanwhile,
        "back_after_s": back_after,
        "replicas_seen": sorted(replicas_seen),
    }


def main() -> None:
    result: dict = {}
    ray.init(
        num_cpus=4,
        object_store_memory=100 * 2**20,
        include_dashboard=False,
        _temp_dir=TEMP_DIR,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        t0 = time.monotonic()
        deploy("prefix", cli=True)
        result["deploy_s"] = time.monotonic() - t0
        result["openai"] = openai_client_run()
        result["prefix"] = shared_prefix_run()
        result["kill"] = kill_run()
        serve.delete("ruvllm")
        deploy("round_robin")  # fresh replicas: empty prefix caches, as the first run had
        result["round_robin"] = shared_prefix_run()
    finally:
        print("RESULT", json.dumps(result), flush=True)
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
