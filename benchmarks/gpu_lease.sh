#!/usr/bin/env bash
# bench_gpu.py within one short device lease (the device tool's 15 minutes, one call): the attention
# part at Llama-3-8B's and SmolLM2's shapes in bfloat16, then the Llama-3-8B-shaped model with the Pallas
# kernels, then the HF transformers peer, each in its own process under its own time limit, so a part
# that fails or runs long leaves the others' figures. Every finished row is also printed as it lands
# ("row {...}" on stderr), so a part cut off by its limit still reports what it measured.
#
# Run from the repository root on a machine whose python3 has jax with CUDA, torch and transformers;
# wheels of ruvllm-core's other dependencies for that python may wait in .whl/ (see the device tool's
# README). Output goes to $OUT (default /tmp/gpu_lease). PARTS picks the parts (attention, probe, model,
# peer; default: all but the probe); all four take about 10 minutes of GPU time, so within one lease run
# PARTS="attention model" and PARTS="probe peer" as two calls on the same warm machine (the peer's
# compile alone takes about two minutes; docs/benchmarks.md says how the first H200 figures were taken).
set -u
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/packages/ruvllm-core/src:$PWD/packages/ruvllm-backend-jax/src${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/device.txt"

BENCH="python3 benchmarks/bench_gpu.py --dtypes bfloat16 --iterations ${ITERATIONS:-10}"
# JAX takes a fixed share of the GPU's memory; the peer runs in its own process afterwards.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.6}
PARTS=" ${PARTS:-attention model peer} "
[[ $PARTS == *" attention "* ]] && timeout "${ATTN_S:-200}" $BENCH --no-model --attn-shapes llama3-8b smollm2 --decode-splits ${DECODE_SPLITS:-1 8} --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
if [[ $PARTS == *" probe "* ]]; then  # where a step's time goes, layers scanned and unrolled
    for unroll in false true; do
        UNROLL_LAYERS=$unroll timeout "${PROBE_S:-90}" python3 benchmarks/gpu_step_probe.py pallas 2>&1 | tee -a "$OUT/probe.log"
    done
fi
[[ $PARTS == *" model "* ]] && timeout "${MODEL_S:-210}" $BENCH --attn-shapes --models llama3-8b --attentions ${ATTENTIONS:-pallas} --no-peer --unroll-layers ${UNROLL:-auto} \
    --model-batches ${BATCHES:-1 32 256} --model-steps 16 --json "$OUT/model.json" 2>&1 | tee "$OUT/model.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[[ $PARTS == *" peer "* ]] && timeout "${PEER_S:-330}" $BENCH --attn-shapes --models llama3-8b --attentions \
    --model-batches ${PEER_BATCHES:-1 256} --model-steps 16 --json "$OUT/peer.json" 2>&1 | tee "$OUT/peer.log"
echo "done"
