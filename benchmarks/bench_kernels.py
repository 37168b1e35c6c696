"""The native panel kernels alone, per ISA variant, and optionally against another commit's source.

Compiles ``cpu_kernels_variant.cc`` once per variant with the flags the package uses
(``native/variants.py``), links the builds into one ``kernel_bench`` (``benchmarks/kernel_bench.cc``)
and times them call by call interleaved in that one process, single-threaded: SmolLM2's Q4_1 gate
and Gemma-3-270M Q4_K_M's matrix shapes (Q5_0 q/gate/up, Q4_K o_proj, Q6_K ffn_down, the Q8_0
attn_v) at one activation row (decode) and 128 (a prompt chunk), and the tied Q8_0 LM head (168 MB,
memory-bound) at one row. With ``--base REF`` every variant is also built from the kernel sources at
git ref REF, and the report gives each shape's time before and after: the way to measure a kernel
change on a shared VM, whose drift between processes is larger than most changes.

    python benchmarks/bench_kernels.py                      # the variants this CPU runs
    python benchmarks/bench_kernels.py --base HEAD~1 --isa avx2

Needs a C++17 compiler (``$CXX``, else ``g++``); x86-64 or aarch64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import cpu_summary

ROOT = Path(__file__).resolve().parent.parent
NATIVE_REL = "packages/ruvllm-backend-jax/src/ruvllm_jax/native"
NATIVE = ROOT / NATIVE_REL
#: The variant's translation unit; it includes the other kernel sources (headers and .inc bodies), which
#: differ between commits, so a ref's are taken as its tree lists them.
VARIANT_SOURCE = "cpu_kernels_variant.cc"

#: k-quant factor forms (kernel_bench's KQUANT): none, per 16 with mins (Q2_K / Q3_K, mixed layers), per 32 with
#: mins (Q4_K / Q5_K as the file has them), symmetric per 16 (Q6_K as the file has it).
PLAIN, K16, K32, KSYM = 0, 1, 2, 3

#: (name, bits, rows N, inputs K, k-quant form, most activation rows timed): Gemma-3-270M Q4_K_M's matrices,
#: SmolLM2's Q4_1 gate/up.
SHAPES = [
    ("q4_1 smollm2 gate 1536x576", 4, 1536, 576, PLAIN, None),
    ("q5_0 gate/up 2048x640", 5, 2048, 640, PLAIN, None),
    ("q4_k o_proj 640x1024", 4, 640, 1024, K32, None),
    ("q6_k ffn_down 640x2048", 6, 640, 2048, KSYM, None),
    ("q4_k/16 o_proj 640x1024", 4, 640, 1024, K16, None),
    ("q8_0 attn_v 256x640", 8, 256, 640, PLAIN, None),
    ("q8_0 lm_head 262144x640", 8, 262144, 640, PLAIN, 1),
]
#: Llama-3.1-8B's Q4_K_M matrices (``--large``): the q/o projection, gate/up, the Q6_K down projection; its gate in
#: Q4_0 and Q8_0.
LARGE = [
    ("q4_k 8b q_proj 4096x4096", 4, 4096, 4096, K32, None),
    ("q4_k 8b gate 14336x4096", 4, 14336, 4096, K32, None),
    ("q6_k 8b ffn_down 4096x14336", 6, 4096, 14336, KSYM, None),
    ("q4_0 8b gate 14336x4096", 4, 14336, 4096, PLAIN, None),
    ("q8_0 8b gate 14336x4096", 8, 14336, 4096, PLAIN, None),
]


def default_builds() -> list[str]:
    """The vector variants this CPU runs, as the installed library chooses them (its own CPU
    detection), named by the build each runs (``avxvnni_evex`` on AVX-512 VNNI without AVX-VNNI)."""
    from ruvllm_jax import native

    builds = []
    for isa in native.supported_isas():
        if isa != "scalar":
            with native.use_isa(isa):
                builds.append(native.isa_build())
    return builds


def source_tree(ref: str | None, into: Path) -> Path:
    """The kernel sources of git ref ``ref`` (None: this working tree)."""
    if ref is None:
        return NATIVE
    into.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:{NATIVE_REL}"], capture_output=True, text=True
    )
    if listed.returncode != 0:
        raise SystemExit(f"--base {ref}: no {NATIVE_REL} there ({listed.stderr.strip()})")
    names = [n for n in listed.stdout.split() if n.startswith("cpu_kernels") and n.endswith((".cc", ".h", ".inc"))]
    for name in names:
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:{NATIVE_REL}/{name}"], capture_output=True, check=False
        )
        if shown.returncode != 0:
            raise SystemExit(f"--base {ref}: no {NATIVE_REL}/{name} there ({shown.stderr.decode().strip()})")
        (into / name).write_bytes(shown.stdout)
    return into


def build(cxx: str, work: Path, builds: list[tuple[str, Path, list[str]]], common: list[str]) -> Path:
    """Compile each (label, source dir, flags) as variant ``label`` and link kernel_bench."""

    def one(label: str, src: Path, flags: list[str]) -> Path:
        obj = work / f"{label}.o"
        cmd = [cxx, *common, *flags, f"-I{src}", f"-DRUVLLM_VARIANT={label}", "-c", str(src / VARIANT_SOURCE)]
        cmd += ["-o", str(obj)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"compiling {label} failed:\n{done.stderr[-2000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objs = list(pool.map(lambda b: one(*b), builds))
    exe = work / "kernel_bench"
    tables = " ".join(f"X({label})" for label, _, _ in builds)
    cmd = [cxx, *common, f"-I{NATIVE}", f"-DRUVLLM_TABLES={tables}", str(ROOT / "benchmarks/kernel_bench.cc"),
           *map(str, objs), "-o", str(exe)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"linking kernel_bench failed:\n{done.stderr[-2000:]}")
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--isa", help="comma-separated variant builds, e.g. avx2,avxvnni_evex (default: the vector ones this CPU runs)"
    )
    ap.add_argument("--base", help="also build the kernels of this git ref and report before/after")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 128], help="activation rows (default: 1 128)")
    ap.add_argument("--rounds", type=int, default=21, help="interleaved rounds per shape; medians (default 21)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--large", action="store_true", help="Llama-3.1-8B's shapes instead of the small models'")
    ap.add_argument("--only", help="only the shapes whose name contains this")
    args = ap.parse_args(argv)

    variants_py = runpy.run_path(str(NATIVE / "variants.py"))
    machine = variants_py["normalise_machine"](platform.machine())
    if machine is None:
        raise SystemExit(f"no kernel variants for machine {platform.machine()}")
    isas = args.isa.split(",") if args.isa else default_builds()
    known = variants_py["VARIANTS"][machine]
    unknown = [i for i in isas if i not in known or i == "scalar"]
    if unknown or not isas:
        raise SystemExit(f"--isa: {', '.join(unknown) or 'none'} (this machine's vector variants: "
                         f"{', '.join(v for v in known if v != 'scalar')})")  # fmt: skip
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise SystemExit("no C++ compiler (set CXX or install g++)")
    common = list(variants_py["COMMON_FLAGS"])

    with tempfile.TemporaryDirectory(prefix="ruvllm-kernels-") as tmp:
        work = Path(tmp)
        base_src = source_tree(args.base, work / "base") if args.base else None
        builds: list[tuple[str, Path, list[str]]] = []
        for isa in isas:
            if base_src is not None:
                builds.append((f"{isa}_base", base_src, known[isa]))
            builds.append((isa, NATIVE, known[isa]))
        exe = build(cxx, work, builds, common)
        print(f"cpu: {cpu_summary()}; one thread; medians of {args.rounds} interleaved rounds")
        print(f"builds: {', '.join(label for label, _, _ in builds)}" + (f" (base: {args.base})" if args.base else ""))
        rows = []
        shapes = [s for s in (LARGE if args.large else SHAPES) if args.only is None or args.only in s[0]]
        for name, bits, n, k, kq, most in shapes:
            for m in (m for m in args.rows if most is None or m <= most):
                reps = max(3, int(3e8 // (n * k * m)))
                out = subprocess.run(
                    [str(exe), str(bits), str(n), str(k), str(m), str(kq), str(reps), str(args.rounds)],
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                us = {label: float(t) for label, t in (line.split() for line in out.splitlines())}
                row = {"shape": name, "rows": m, "us": us, "gprod_s": {b: n * k * m / t / 1e3 for b, t in us.items()}}
                rows.append(row)
                cells = []
                for isa in isas:
                    cell = f"{isa} {us[isa]:.1f} us ({row['gprod_s'][isa]:.1f} Gprod/s)"
                    if args.base:
                        cell += f", base {us[isa + '_base']:.1f} us: {us[isa + '_base'] / us[isa]:.2f}x"
                    cells.append(cell)
                print(f"{name:26s} M={m:<4d} " + "; ".join(cells))
        if args.base:
            for isa in isas:
                ratios = [r["us"][isa + "_base"] / r["us"][isa] for r in rows]
                print(f"{isa}: median speed-up over {args.base}: {statistics.median(ratios):.2f}x")
        if args.json:
            args.json.write_text(json.dumps({"cpu": cpu_summary(), "base": args.base, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
