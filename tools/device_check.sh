#!/usr/bin/env bash
# The GPU checks of docs/performance.md in one command, for a lent GPU machine with
# JAX and its CUDA plugin but no hydra-core (carried as pure-Python packages in .pylib:
# hydra, omegaconf, antlr4, copied from a machine where `pip install -e .` ran).
# Writes under $OUT (default ./device_out) one log of every step, device_check.log
# (tools/mock_gpu.py leaves out XLA:GPU's lines about the mock topology), and a JSON
# file per mock_gpu step: nine files, within what a lent machine's call hands back.
# Each step has its own time limit, so one failure does not cost the others.
# Profiled steps run without CUDA graphs (framework/analysis/device_time.py: the profile
# would not see inside them), about 2% slower than the same rows unprofiled.
#   bash tools/device_check.sh [bench_s] [mock_1b_s] [none_s] [dots_s] [mock_8b_s] [moe_s]
#                              [fp8_8b_s] [fp8_bench_s] [dots_8b_s] [fp8_nostats_s]
#                              [fp8_delayed_s] [bench_dots28_s] [ring_pieces_s]
#                              [ring_128k_s] [ring_128k_blockwise_s]
#   (SKIP_BENCH=1: no 1. and no FP8 bench; FP8_ONLY=1: only 6., 8. and 9., e.g. as a second call:
#   the limits of 1.-6. add up to more than one device call's 600 s)
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.pylib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu \
    --format=csv; $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, \
    'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); \
    print(jax.devices())"; } > "$OUT/device_check.log" 2>&1
step() {  # name, seconds, command...: its output into the log, its last lines shown
  local name=$1 secs=$2 t0=$SECONDS; shift 2
  { echo "== $name (limit ${secs} s)"
    timeout --kill-after=5 "$secs" "$@" > "$OUT/step.log" 2>&1; local rc=$?
    cat "$OUT/step.log"; echo "== $name rc=$rc in $((SECONDS - t0)) s"; } >> "$OUT/device_check.log"
  echo "== $name rc=$rc in $((SECONDS - t0)) s"; grep -v "^ " "$OUT/step.log" | tail -n 12
  rm -f "$OUT/step.log"
}
cat "$OUT/device_check.log"
# Within 8 minutes on one H100/H200 (issue 43): each step its own limit, the most
# important first. Rows are one GPU's share of each stage (mock topology, no comms).
if [ -z "${FP8_ONLY:-}" ]; then
# 1. MFU of the one-GPU recipe (cuDNN attention) against its plain-JAX reference, profiled;
# beside it the same step under save_dots (41.6 against 65.1 GiB, 510 against 530 GiB
# read and written by the kernels: the GPU compiler's program, 2026-12-02; the 8-GPU
# stage ran 4% faster under save_dots than without remat, 2026-11-30).
[ -z "${SKIP_BENCH:-}" ] && step bench "${1:-110}" $PY tools/bench.py recipe=llama_1b_1gpu \
  devices.platform=gpu --no-defaults --pairs 6 --rounds 2 --attention "" --profile \
  --layout 1,1,1:remat=save_dots
# 1b. The one-GPU step under save_dots at the batch its memory allows (28 rows: 64.5 GiB
# compiled, predicted 68.7 of the 72 XLA may take; 33.5 GiB read and written by the
# kernels a row against the recipe's 37.9 at 14 rows: the GPU compiler's program,
# 2026-12-02): issue 43's lever for 55% MFU on one GPU.
[ -z "${SKIP_BENCH:-}" ] && step bench_dots28 "${12:-100}" $PY tools/bench.py \
  recipe=llama_1b_1gpu devices.platform=gpu parallel.remat=save_dots \
  train.global_batch_size=28 --no-defaults --pairs 4 --rounds 2 --attention ""
# 1c. cuDNN's pieces of ring attention (the 128k recipe's kernel since 2026-12-02:
# framework/model/fused_pieces.py) against their plain-JAX reference, which the CPU
# tests run in their place: forward, and the backward handed a whole ring's statistics.
step ring_pieces "${13:-60}" $PY tools/fused_pieces_check.py
# 2. The 1B 8-GPU recipe's last stage (the head's), every tick schedule, as shipped
# (save_dots since 2026-11-30).
step mock_1b "${2:-120}" $PY tools/mock_gpu.py recipe=llama_1b_8gpu \
  --schedules 1f1b,interleaved_1f1b:2,zb_h1,zb_v --stage last --steps 3 --json "$OUT/mock_1b.json"
# 3. The same without remat and under full remat (the stash's traffic: docs/performance.md).
step mock_1b_none "${3:-70}" $PY tools/mock_gpu.py recipe=llama_1b_8gpu parallel.remat=none \
  --schedules 1f1b,zb_v --stage last --steps 3 --json "$OUT/mock_1b_none.json"
step mock_1b_full "${4:-45}" $PY tools/mock_gpu.py recipe=llama_1b_8gpu parallel.remat=full \
  --schedules 1f1b --stage last --steps 3 --json "$OUT/mock_1b_full.json"
# 4. The 8B recipe's last stage as shipped (cuDNN attention since 2026-11-27), profiled.
step mock_8b "${5:-130}" $PY tools/mock_gpu.py recipe=llama3_8b \
  --schedules 1f1b,zb_v --stage last --steps 2 --profile --json "$OUT/mock_8b.json"
# 5. The MoE recipe's last stage (issue 44: Qwen3-30B-A3B's shape, 128 experts top 8,
# capacity factor 1.25: the slots as batched matmuls; expert 4), combined cells as
# shipped and separate (one GPU's share: what combining costs without the all-to-alls
# it hides), profiled.
step mock_moe "${6:-100}" $PY tools/mock_gpu.py recipe=qwen3_30b_a3b \
  --schedules interleaved_1f1b:8/combined,interleaved_1f1b:8/separate --stage last --steps 2 \
  --profile --json "$OUT/mock_moe.json"
fi
# 6. FP8 (issue 45): the 8B recipe's last stage with model.fp8=tensorwise, against the
# bfloat16 rows of 4.; then the one-GPU bench with FP8 (its plain-JAX reference runs the
# same FP8 layers: the bfloat16 figures are 1.'s, on the same device).
step mock_8b_fp8 "${7:-90}" $PY tools/mock_gpu.py recipe=llama3_8b model.fp8=tensorwise \
  --schedules 1f1b --stage last --steps 2 --json "$OUT/mock_8b_fp8.json"
[ -z "${SKIP_BENCH:-}" ] && step bench_fp8 "${8:-90}" $PY tools/bench.py recipe=llama_1b_1gpu \
  devices.platform=gpu model.fp8=tensorwise --no-defaults --pairs 4 --rounds 2 --attention ""
# 7. The 8B stage under full remat (4.'s rows are the recipe's save_dots: 46.5 GiB on an
# H200, 8% faster than full remat under 1F1B, 2026-11-30), 1F1B and ZB-V.
[ -z "${FP8_ONLY:-}" ] && step mock_8b_full "${9:-80}" $PY tools/mock_gpu.py recipe=llama3_8b \
  parallel.remat=full --schedules 1f1b,zb_v --stage last --steps 2 --json "$OUT/mock_8b_full.json"
# 8. What FP8's per-step statistics cost (the fp8/ metrics: 2,091 of the 8B program's
# 38,954 kernels a step, compiler's count, 2026-11-30): the 8B stage with FP8, without
# them, against 6.'s first row (log only).
step mock_8b_fp8_nostats "${10:-70}" $PY tools/mock_gpu.py recipe=llama3_8b \
  model.fp8=tensorwise model.fp8_stats=false --schedules 1f1b --stage last --steps 2
# 9. Delayed scaling (model.fp8=delayed: no maximum and no all-reduce before a cast;
# 177 GiB a step less read and written than 8.'s program, compiler's count, 2026-11-30),
# the same stage and settings as 8. (log only; its first, untimed step fills the
# histories with current scaling, a second compile).
step mock_8b_fp8_delayed "${11:-90}" $PY tools/mock_gpu.py recipe=llama3_8b \
  model.fp8=delayed model.fp8_stats=false --schedules 1f1b --stage last --steps 2
# 10. One device's share of the 128k recipe (context 8 x tensor 8 on 64 GPUs: the ring's
# shifts and the tensor rings are no-ops here), its ring on cuDNN's pieces as shipped
# since 2026-12-02, then on the blockwise pieces it ran before (4.66 million kernels and
# 11.5 TB of kernel traffic a step against 98,704 and 2.5 TB: the GPU compiler's
# program, 2026-12-02). Its times mean something once 1c has passed (the pieces' numbers).
if [ -z "${FP8_ONLY:-}" ]; then
step mock_128k "${14:-150}" $PY tools/mock_gpu.py recipe=llama3_8b_128k --steps 2 \
  --json "$OUT/mock_128k.json"
step mock_128k_blockwise "${15:-200}" $PY tools/mock_gpu.py recipe=llama3_8b_128k \
  model.attention=blockwise --steps 2 --json "$OUT/mock_128k_blockwise.json"
fi
exit 0
