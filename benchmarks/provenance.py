"""What ran where, for the benchmark reports: the CPU (model and ISA flags from /proc/cpuinfo), the
ISA variant of ruvllm's native kernels, the model file's weight types and the llama.cpp build (the
CPU features it was compiled for and the CMake arguments the nox ``bench`` session built it with).
Figures without these cannot be compared with figures from another machine, file or build.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections import Counter
from pathlib import Path

#: The flags that decide which integer dot-product kernels can run (ruvllm's variants, llama.cpp's).
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
)
#: The nox ``bench`` session writes the CMAKE_ARGS it built llama-cpp-python with here, in its venv.
LLAMA_CPP_CMAKE_ARGS_FILE = "llama-cpp-python.cmake-args"
#: llama.cpp's compile-time features, best first, named like ruvllm's ISA variants where they match.
LLAMA_CPP_ISAS = (
    ("AMX_INT8", "amx-int8"),
    ("AVX512_VNNI", "avx512vnni"),
    ("AVX_VNNI", "avxvnni"),
    ("AVX512", "avx512"),
    ("AVX2", "avx2"),
    ("MATMUL_INT8", "neon-i8mm"),
    ("DOTPROD", "neon-dotprod"),
    ("NEON", "neon"),
)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is no such file)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    info = _cpuinfo()
    if info.get("model name"):
        return info["model name"]
    if info.get("CPU part"):  # aarch64 names no model, only the implementer and part numbers
        return f"{platform.machine()} implementer {info.get('CPU implementer', '?')} part {info['CPU part']}"
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The :data:`ISA_FLAGS` this CPU advertises."""
    info = _cpuinfo()
    have = set((info.get("flags") or info.get("Features") or "").split())
    return [f for f in ISA_FLAGS if f in have]


def cpu_summary() -> str:
    return f"{cpu_model()}, {os.cpu_count()} CPUs, ISA flags: {' '.join(cpu_flags()) or 'none known'}"


def native_isa() -> str | None:
    """The ISA variant the jax backend's native kernels run, None when they are not loaded."""
    from ruvllm_jax import native

    isa = getattr(native, "isa", None) or native.vector_path  # vector_path: before the per-ISA library
    return isa()


def native_isas() -> list[str]:
    """The variants of the native kernels this CPU can run, worst first."""
    from ruvllm_jax import native

    supported = getattr(native, "supported_isas", None)
    if supported is not None:
        return supported()
    path = native.vector_path()  # before the per-ISA library: the one path it was compiled for
    return [path] if path else []


def gguf_weights(path: Path) -> str:
    """The file's type (``Q4_K_M``) and its matrices' block types (``Q4_K x186, Q6_K x25``); a mixture
    of experts' stacks (three dimensions) count as one matrix tensor each."""
    if path.suffix != ".gguf":
        return "not a GGUF file"
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    kind = "?"
    if field is not None:
        code = int(field.parts[field.data[0]][0])
        try:
            kind = gguf.LlamaFileType(code).name.removeprefix("MOSTLY_")
        except ValueError:
            kind = str(code)
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return f"{kind} ({', '.join(f'{k} x{n}' for k, n in counts.most_common())})"


def llama_cpp_build() -> dict[str, str] | None:
    """Which llama.cpp the peer runs: the package version, the CPU features it was compiled for
    (``llama_print_system_info``: ``AVX512_VNNI = 1`` ...), the best of them (``isa``) and the
    CMAKE_ARGS of its build where the nox ``bench`` session recorded them; None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info().decode().strip()
    on = set(re.findall(r"(\w+) = 1", info))
    stamp = Path(sys.prefix) / LLAMA_CPP_CMAKE_ARGS_FILE
    return {
        "version": llama_cpp.__version__,
        "isa": next((name for flag, name in LLAMA_CPP_ISAS if flag in on), "scalar"),
        "system_info": info,
        "cmake_args": stamp.read_text().strip() if stamp.exists() else "unknown (not built by nox -s bench)",
    }


def llama_cpp_summary(build: dict[str, str]) -> str:
    return (
        f"llama-cpp-python {build['version']}, CMAKE_ARGS={build['cmake_args']!r}; "
        f"compiled for: {build['system_info']}"
    )
