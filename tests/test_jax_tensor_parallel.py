"""Tensor parallelism over two host devices gives the greedy tokens of a single device, with the
weights and KV cache really split: a tiny Llama whose heads divide by two (attention, MLP and
vocabulary sharded) and SmolLM2 (9 heads do not divide by two: MLP and vocabulary sharded,
attention replicated). Runs in a subprocess so XLA_FLAGS can create the two CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys
from pathlib import Path
import jax
import numpy as np
sys.path.insert(0, sys.argv[1])
from _gguf_files import write_tiny_llama_gguf
from _jax_fixtures import GreedyDecoder, load_jax
from ruvllm.checkpoint import open_checkpoint

assert len(jax.devices()) == 2, jax.devices()
result = {}

def shards(x):
    x = getattr(x, "quant", x)  # a QuantArray: its integer matrix
    return [tuple(s.data.shape) for s in x.addressable_shards]

def compare(name, ckpt, prompts, new_tokens, **options):
    one = load_jax(ckpt, **options)
    two = load_jax(ckpt, extra={"tensor_parallel": 2}, **options)
    w = two.weights
    cache = two.allocate_cache(8, 16)
    result[name] = {
        "single": GreedyDecoder(one).run(prompts, new_tokens),
        "parallel": GreedyDecoder(two).run(prompts, new_tokens),
        "q_proj_shards": shards(w.layers.q_proj),
        "gate_proj_shards": shards(w.layers.gate_proj),
        "down_proj_shards": shards(w.layers.down_proj),
        "embed_shards": shards(w.embed),
        "cache_shards": shards(cache.state.k),
        "config": [ckpt.config.num_heads, ckpt.config.num_kv_heads, ckpt.config.intermediate_size],
    }

tiny = open_checkpoint(write_tiny_llama_gguf(Path(sys.argv[2]) / "tiny.gguf", hidden=64, layers=2))
rng = np.random.default_rng(0)
tiny_prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 9)]
compare("tiny", tiny, tiny_prompts, 12)
compare("tiny_w8a8", tiny, tiny_prompts, 12, quantization="w8a8")
if len(sys.argv) > 3:
    smol = open_checkpoint(sys.argv[3])
    tok = smol.tokenizer()
    compare("smollm2", smol, [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")], 16)
print("RESULT" + json.dumps(result))
"""


@pytest.mark.slow
# Above the subprocess's own limit (900 s): that limit fails this test alone, with the output.
@pytest.mark.timeout(1200)
def test_two_devices_match_one(tmp_path: Path, smollm2_path: Path) -> None:
    tests_dir = Path(__file__).parent
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "RUVLLM_LOG": "ERROR",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tests_dir), str(tmp_path), str(smollm2_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    res = json.loads(line[len("RESULT") :])

    tiny = res["tiny"]
    assert tiny["parallel"] == tiny["single"]
    # 4 heads, 2 kv heads of 16, ffn 128, hidden 64, vocab 258: everything with a parallel axis splits.
    assert [tuple(s) for s in tiny["q_proj_shards"]] == [(2, 32, 64)] * 2
    assert [tuple(s) for s in tiny["gate_proj_shards"]] == [(2, 64, 64)] * 2
    assert [tuple(s) for s in tiny["down_proj_shards"]] == [(2, 64, 64)] * 2
    assert [tuple(s) for s in tiny["embed_shards"]] == [(129, 64)] * 2
    assert [tuple(s) for s in tiny["cache_shards"]] == [(2, 8, 16, 1, 16)] * 2

    # w8a8: int8 weights and their smoothing factors split the same way; same tokens as one device.
    assert res["tiny_w8a8"]["parallel"] == res["tiny_w8a8"]["single"]
    assert [tuple(s) for s in res["tiny_w8a8"]["gate_proj_shards"]] == [(2, 64, 64)] * 2

    smol = res["smollm2"]
    assert smol["parallel"] == smol["single"]
    assert smol["config"] == [9, 3, 1536]
    assert [tuple(s) for s in smol["q_proj_shards"]] == [(30, 576, 576)] * 2  # replicated: 9 heads
    assert [tuple(s) for s in smol["gate_proj_shards"]] == [(30, 768, 576)] * 2
    assert [tuple(s) for s in smol["embed_shards"]] == [(24576, 576)] * 2
    assert [tuple(s) for s in smol["cache_shards"]] == [(30, 8, 16, 3, 64)] * 2
