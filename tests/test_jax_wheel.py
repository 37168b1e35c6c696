"""The JAX backend as a platform wheel: the native kernels are compiled when the wheel is built, not
when it is used.

``pip wheel packages/ruvllm-backend-jax`` builds a wheel holding the kernel library (every ISA
variant of this architecture, none built with ``-march=native``). Unpacked on its own and imported
with no C++ compiler on PATH, it loads the library, picks the best variant this CPU runs, and a
jitted product through it equals the scalar variant's. Then ``ruvllm serve`` answers a chat request
with the backend coming from that wheel, still without a compiler on PATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
from _server_fixtures import free_port, wait_until_ready

ROOT = Path(__file__).resolve().parents[1]
# Building the wheel compiles every kernel variant (about 2 minutes on a busy 2-core machine, in the
# first test's setup): a slow module, with room for a slower runner.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(ROOT / "packages/ruvllm-backend-jax")],
        capture_output=True,
        text=True,
        env={**os.environ, "RUVLLM_NATIVE_REQUIRED": "1"},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("ruvllm_backend_jax-*.whl")
    # A platform wheel: tagged for this OS and architecture, not py3-none-any.
    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert any(n.startswith("ruvllm_jax/native/_cpu_kernels") for n in names), names
        zf.extractall(target)
    return target


def _no_compiler_env(site: Path) -> dict[str, str]:
    """PATH holding only the interpreter's directory (which has no compiler), the wheel first on
    sys.path."""
    bindir = Path(sys.executable).parent
    for cc in ("cc", "c++", "gcc", "g++", "clang", "clang++"):
        assert not (bindir / cc).exists()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "RUVLLM_CPU_ISA")}
    env.update(PATH=str(bindir), PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    return env


def test_wheel_kernels_load_and_run_without_a_compiler(wheel_dir):
    code = """
import shutil
import jax.numpy as jnp, numpy as np
from ruvllm_jax import native
from ruvllm_jax.quant import quantize_wxa8, to_panels
assert all(shutil.which(c) is None for c in ("cc", "c++", "gcc", "g++", "clang++"))
assert native.available(), native.unavailable_reason()
print(native.library_path())
w = to_panels(quantize_wxa8(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32), 4))
ops = [(jnp.asarray(w.quant), jnp.asarray(w.scale), jnp.asarray(w.offset))]
x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
best = np.asarray(native.wxa8_group(x, jnp.int32(0), ops, panel=True)[0])
with native.use_isa("scalar"):
    ref = np.asarray(native.wxa8_group(x, jnp.int32(0), ops, panel=True)[0])
assert np.array_equal(best, ref)
print(native.isa(), ",".join(native.supported_isas()))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=_no_compiler_env(wheel_dir), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, isas = proc.stdout.strip().splitlines()[-2:]
    assert Path(path).is_relative_to(wheel_dir)  # the wheel's library, not the editable install's
    isa, supported = isas.split()
    assert isa == supported.split(",")[-1]


def test_server_answers_from_the_wheel_without_a_compiler(wheel_dir, smollm2_path, tmp_path):
    env = _no_compiler_env(wheel_dir)
    env["RUVLLM_LOG"] = "INFO"
    port = free_port()
    log = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ruvllm", "serve", str(smollm2_path), "--served-model-name", "smollm2",
             "--backend", "jax", "--port", str(port), "--no-precompile"],
            stdout=subprocess.DEVNULL, stderr=err, env=env,
        )  # fmt: skip
    try:
        wait_until_ready(base, proc, log, 300)
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_tokens": 8,
                  "temperature": 0},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    # The wheel's library served, with its best variant; quantization auto resolved to w4a8.
    assert "native cpu kernels loaded" in text and str(wheel_dir) in text, text[-3000:]
    assert '"quantization": "w4a8"' in text, text[-3000:]
