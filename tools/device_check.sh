#!/usr/bin/env bash
# The GPU checks of docs/performance.md in one command, for a lent GPU machine with
# JAX and its CUDA plugin but no hydra-core (carried as pure-Python packages in .pylib:
# hydra, omegaconf, antlr4, copied from a machine where `pip install -e .` ran).
# Writes logs under $OUT (default ./device_out). Each step has its own time limit, so
# one failure does not cost the others.
#   bash tools/device_check.sh [bench_s] [mock_s] [probe_s] [mock_v_s]   (SKIP_BENCH=1: no 1.)
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.pylib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu \
    --format=csv; $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, \
    'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); \
    print(jax.devices())"; } 2>&1 | tee "$OUT/env.txt"
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs} s)"; local t0=$SECONDS
  timeout --kill-after=5 "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc in $((SECONDS - t0)) s"; tail -n 25 "$OUT/$name.log"
}
# 1. MFU of the one-GPU recipe (cuDNN attention), its plain-JAX reference, blockwise.
[ -z "${SKIP_BENCH:-}" ] && step bench "${1:-200}" $PY tools/bench.py recipe=llama_1b_1gpu devices.platform=gpu \
  --no-defaults --pairs 10 --attention dense,blockwise --markdown "$OUT/bench.md"
# 2. The 8-GPU recipe's schedules, this GPU's share of each stage (mock topology, no comms).
step mock "${2:-220}" $PY tools/mock_gpu.py recipe=llama_1b_8gpu \
  --schedules gpipe,1f1b,zb_h1,zb_v --stage all --steps 4 --json "$OUT/mock.json"
step mock_v "${4:-150}" $PY tools/mock_gpu.py recipe=llama_1b_8gpu parallel.virtual_stages=2 \
  --schedules interleaved_1f1b --stage all --steps 4 --json "$OUT/mock_v.json"
# 3. Does this jaxlib's GPU compiler still copy what a conditional passes through?
step probe "${3:-90}" $PY tools/dispatch_probe.py aot
exit 0
