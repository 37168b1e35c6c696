#!/usr/bin/env bash
# bench_gpu.py within one short device lease (the device tool's 15 minutes, one call): parts on the
# Llama-3-8B-shaped model (random bf16 weights made on the device), each in its own process under its
# own time limit, so a part that fails or runs long leaves the others' figures. Every finished row is
# also printed as it lands ("row {...}" on stderr), so a part cut off by its limit still reports what it
# measured. Compiled steps are kept in jax's cache (~/.cache/ruvllm/jax): a rerun on the same warm
# machine loads them instead of compiling, and its minutes go to measuring.
#
# Run from the repository root on a machine whose python3 has jax with CUDA, torch and transformers;
# wheels of ruvllm-core's other dependencies for that python may wait in .whl/ (see the device tool's
# README). Output goes to $OUT (default /tmp/gpu_lease). PARTS picks the parts (splits, forms, attention,
# probe, model, peer; default: splits forms, issue 42's next figures, about 9 minutes of GPU time together
# under their limits):
#   splits: Llama-3-8B-shaped bf16 model at batch 1 and 4 after 512-token prompts, the decode kernel's
#           parts chosen automatically (decode_splits auto: 4 and 4 on 132 SMs, bounded by the 544-key
#           tables) against one part and 16 forced (the SM bound alone), in one process, and with the
#           automatic parts steps of 5 tokens a sequence (speculation's verification of 4 drafts: what
#           n-gram speculation must accept at batch 1 to pay on this card);
#   forms:  bf16 against q8 (int8 weights, bf16 activations: w8a16) and fp8 (e4m3 weights), batch 1 in
#           one process (FORMS1_S), then batch 256 in another (FORMS_S), each form's floor from its own
#           weight bytes and the bandwidth measured in that process; at batch 1 also q8-channel (int8
#           with a scale per output channel, applied after the product: whether XLA fuses q8's group
#           scales into its GEMM shows as the two apart).
#   spec:   (not by default) issue 45's engine at batch 1 with and without n-gram speculation
#           (bench_speculative.py, --quantization none: bf16 on the GPU) on SPEC_MODEL (default
#           smollm2), first SPEC_LIMIT prompts of each set. The device has no model files and a call
#           carries 64 MiB, less than SmolLM2's GGUF (101 MiB): the file must reach the machine first.
#   invariant: (not by default) issue 44's --batch-invariant on INV_MODEL (default smollm2; its file must
#           reach the machine first, as spec's), --quantization none (bf16): 24 greedy answers alone and
#           together, and decode tok/s at batch 1 and 8 (bench_batch_invariant.py), without the option
#           and with it, one process each (its XLA flags are read when the GPU backend starts), INV_S
#           (default 120 s) each, the engine limited to INV_SEQS sequences (8) and INV_STEP_TOKENS tokens a
#           step (256): with the option every step computes about that many rows.
# The earlier parts (attention, probe, model, peer: about 10 minutes together) were measured on an H200
# on 2026-11-27 (benchmarks/results/h200-2026-11-27/); run them as a second call on the same warm machine
# (the peer's compile alone takes about two minutes; docs/benchmarks.md says how those were taken).
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
PARTS=" ${PARTS:-splits forms} "
MODEL_ARGS="--attn-shapes --models llama3-8b --attentions ${ATTENTIONS:-pallas} --no-peer --unroll-layers ${UNROLL:-auto} --model-steps 16"
[[ $PARTS == *" splits "* ]] && timeout "${SPLITS_S:-170}" $BENCH $MODEL_ARGS --model-decode-splits auto 1 16 --verify-tokens 5 \
    --model-batches ${SPLIT_BATCHES:-1 4} --json "$OUT/splits.json" 2>&1 | tee "$OUT/splits.log"
if [[ $PARTS == *" forms "* ]]; then  # one process per batch: single stream's three forms land first
    for b in ${FORM_BATCHES:-1 256}; do
        forms=${FORMS:-none q8 fp8}
        limit=${FORMS_S:-170}
        [[ $b == 1 ]] && forms=${FORMS1:-none q8 fp8 q8-channel} && limit=${FORMS1_S:-200}  # 4 forms there
        timeout "$limit" $BENCH $MODEL_ARGS --quantizations $forms --model-batches "$b" \
            --json "$OUT/forms_b$b.json" 2>&1 | tee "$OUT/forms_b$b.log"
    done
fi
[[ $PARTS == *" spec "* ]] && timeout "${SPEC_S:-200}" python3 benchmarks/bench_speculative.py --model "${SPEC_MODEL:-smollm2}" \
    --quantization none --limit "${SPEC_LIMIT:-6}" --max-tokens 128 --no-aggregate --no-llama-cpp --json "$OUT/spec.json" \
    2>&1 | tee "$OUT/spec.log"
if [[ $PARTS == *" invariant "* ]]; then
    for mode in off on; do
        flag=""; [[ $mode == on ]] && flag="--batch-invariant"
        timeout "${INV_S:-120}" python3 benchmarks/bench_batch_invariant.py --model "${INV_MODEL:-smollm2}" \
            --quantization none $flag --prompts "${INV_PROMPTS:-24}" --max-tokens "${INV_TOKENS:-48}" \
            --batches ${INV_BATCHES:-1 8} --max-num-seqs "${INV_SEQS:-8}" \
            --max-num-batched-tokens "${INV_STEP_TOKENS:-256}" \
            --decode-tokens "${INV_DECODE_TOKENS:-64}" --json "$OUT/invariant_$mode.json" 2>&1 | tee "$OUT/invariant_$mode.log"
    done
fi
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
