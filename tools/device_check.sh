#!/usr/bin/env bash
# The GPU checks of docs/performance.md in one command, for a lent GPU machine with
# JAX and its CUDA plugin but no hydra-core (carried as pure-Python packages in .pylib:
# hydra, omegaconf, antlr4, copied from a machine where `pip install -e .` ran).
# Writes under $OUT (default ./device_out) one log of every step, device_check.log
# (tools/mock_gpu.py leaves out XLA:GPU's lines about the mock topology), and a JSON
# file per mock_gpu step that names one: at most four a part, within the eight files
# a lent machine's call hands back (a STEPS= list with more than seven would not be).
# Each step has its own time limit, so one failure does not cost the others, and the
# call has a budget: a step that could end past it is skipped (named in the log), so
# the call ends inside one device command's 600 s.
# Profiled steps run without CUDA graphs (framework/analysis/device_time.py: the profile
# would not see inside them), about 2% slower than the same rows unprofiled.
#   bash tools/device_check.sh                 part 1: what is measured first (below)
#   PART=2 / PART=3 bash tools/device_check.sh the other steps, a call each
#   STEPS=ring_pieces,mock_8b bash tools/device_check.sh    those steps, in that order
#   BUDGET=560 (seconds, the default); LIMIT_<step>=S: that step's own limit (whole s)
# A lent GPU has 15 minutes in all, its start included: part 1 is the call that fits.
set -u
if [ $# -gt 0 ]; then  # (until 2026-12-02 the steps' limits were positional arguments)
  echo "device_check.sh takes no arguments: PART=1|2|3, STEPS=a,b, BUDGET=s, LIMIT_<step>=s"
  exit 2
fi
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
MOCK="$PY tools/mock_gpu.py" BENCH="$PY tools/bench.py" JSON=$(printf %q "$OUT")
# Each step: its default limit in seconds, then what it runs. Rows are one GPU's share
# of each stage (mock topology, no communication).
declare -A LIMIT CMD
# cuDNN's pieces of ring attention (the 128k recipe's kernel since 2026-12-02:
# framework/model/fused_pieces.py) against their plain-JAX reference, which the CPU
# tests run in their place: forward, and the backward handed a whole ring's statistics.
LIMIT[ring_pieces]=60; CMD[ring_pieces]="$PY tools/fused_pieces_check.py"
# The 8B recipe's last stage as shipped (save_dots, cuDNN), 1F1B and ZB-V, profiled:
# its program changed on 2026-12-02 (46.8 GiB instead of 61.8, 180 GiB a step less
# kernel traffic: docs/performance.md, "A scattering ring's parts").
LIMIT[mock_8b]=130; CMD[mock_8b]="$MOCK recipe=llama3_8b --schedules 1f1b,zb_v --stage last \
  --steps 2 --profile --json $JSON/mock_8b.json"
# The one-GPU step under save_dots at the batch its memory allows (28 rows: 64.5 GiB
# compiled, predicted 68.7 of the 72 XLA may take; 33.5 GiB read and written by the
# kernels a row against the recipe's 37.9 at 14 rows: the GPU compiler's program,
# 2026-12-02), against plain JAX at the same batch: issue 43's lever for 55% MFU; beside
# it the same 28 rows without remat as 2 accumulated microbatches of 14 (70.6 GiB
# compiled, 38.9 GiB a row read and written: the compiler sees no gain over the recipe).
LIMIT[bench_dots28]=130; CMD[bench_dots28]="$BENCH recipe=llama_1b_1gpu devices.platform=gpu \
  parallel.remat=save_dots train.global_batch_size=28 --no-defaults --pairs 4 --rounds 2 --attention '' \
  --layout 1,1,1:remat=none:microbatches=2"
# FP8 (issue 45): the 8B stage with model.fp8=tensorwise, against mock_8b's 1F1B row.
LIMIT[mock_8b_fp8]=90; CMD[mock_8b_fp8]="$MOCK recipe=llama3_8b model.fp8=tensorwise \
  --schedules 1f1b --stage last --steps 2 --json $JSON/mock_8b_fp8.json"
# Delayed scaling (no maximum and no all-reduce before a cast; 177 GiB a step less read
# and written, compiler's count, 2026-11-30), against mock_8b_fp8 (the same settings,
# the fp8/ statistics on in both; log only; its first, untimed step fills the
# histories with current scaling, a second compile).
LIMIT[mock_8b_fp8_delayed]=90; CMD[mock_8b_fp8_delayed]="$MOCK recipe=llama3_8b \
  model.fp8=delayed --schedules 1f1b --stage last --steps 2"
# One device's share of the 128k recipe (context 8 x tensor 8 on 64 GPUs: the ring's
# shifts and the tensor rings are no-ops here), its ring on cuDNN's pieces as shipped;
# its time means something once ring_pieces has passed.
LIMIT[mock_128k]=150; CMD[mock_128k]="$MOCK recipe=llama3_8b_128k --steps 2 --json $JSON/mock_128k.json"
# The same on the blockwise pieces it ran before (4.66 million kernels and 11,497 GiB of
# kernel traffic a step against 98,704 and 2,457 GiB: the GPU compiler's program).
LIMIT[mock_128k_blockwise]=200; CMD[mock_128k_blockwise]="$MOCK recipe=llama3_8b_128k \
  model.attention=blockwise --steps 2 --json $JSON/mock_128k_blockwise.json"
# MFU of the one-GPU recipe (cuDNN attention) against its plain-JAX reference, profiled,
# beside the same step under save_dots at the recipe's 14 rows (41.6 against 65.1 GiB,
# 510 against 530 GiB read and written by the kernels: the GPU compiler's program).
LIMIT[bench]=110; CMD[bench]="$BENCH recipe=llama_1b_1gpu devices.platform=gpu --no-defaults \
  --pairs 6 --rounds 2 --attention '' --profile --layout 1,1,1:remat=save_dots"
# The one-GPU bench with FP8 (its plain-JAX reference runs the same FP8 layers; the
# bfloat16 figures are bench's, on the same device: run the two in one call).
LIMIT[bench_fp8]=90; CMD[bench_fp8]="$BENCH recipe=llama_1b_1gpu devices.platform=gpu \
  model.fp8=tensorwise --no-defaults --pairs 4 --rounds 2 --attention ''"
# The 1B 8-GPU recipe's last stage, every tick schedule, as shipped (save_dots); then
# without remat and under full remat (the stash's traffic: docs/performance.md).
LIMIT[mock_1b]=120; CMD[mock_1b]="$MOCK recipe=llama_1b_8gpu \
  --schedules 1f1b,interleaved_1f1b:2,zb_h1,zb_v --stage last --steps 3 --json $JSON/mock_1b.json"
LIMIT[mock_1b_none]=70; CMD[mock_1b_none]="$MOCK recipe=llama_1b_8gpu parallel.remat=none \
  --schedules 1f1b,zb_v --stage last --steps 3 --json $JSON/mock_1b_none.json"
LIMIT[mock_1b_full]=45; CMD[mock_1b_full]="$MOCK recipe=llama_1b_8gpu parallel.remat=full \
  --schedules 1f1b --stage last --steps 3 --json $JSON/mock_1b_full.json"
# The 8B stage under full remat, 1F1B and ZB-V (mock_8b's rows are the recipe's save_dots).
LIMIT[mock_8b_full]=80; CMD[mock_8b_full]="$MOCK recipe=llama3_8b parallel.remat=full \
  --schedules 1f1b,zb_v --stage last --steps 2 --json $JSON/mock_8b_full.json"
# What FP8's per-step statistics cost (the fp8/ metrics: 2,091 of the 8B program's
# 38,954 kernels a step, compiler's count, 2026-11-30), against mock_8b_fp8 (log only;
# an earlier call's: the two fit no single call beside part 1's other steps).
LIMIT[mock_8b_fp8_nostats]=70; CMD[mock_8b_fp8_nostats]="$MOCK recipe=llama3_8b \
  model.fp8=tensorwise model.fp8_stats=false --schedules 1f1b --stage last --steps 2"
# The MoE recipe's last stage (issue 44: Qwen3-30B-A3B's shape, 128 experts top 8,
# capacity factor 1.25; expert 4), combined cells as shipped and separate (one GPU's
# share: what combining costs without the all-to-alls it hides), profiled.
LIMIT[mock_moe]=100; CMD[mock_moe]="$MOCK recipe=qwen3_30b_a3b \
  --schedules interleaved_1f1b:8/combined,interleaved_1f1b:8/separate --stage last --steps 2 \
  --profile --json $JSON/mock_moe.json"
# The 8B stage keeping sequence parallelism's gathered inputs (parallel.remat=
# save_dots_gathered: 66.8 GiB compiled, 20% fewer tensor bytes, 99% of them beside
# matmuls against 89%, but 240 GiB a step more read and written by the kernels: the GPU
# compiler's program, 2026-12-02). One GPU's share runs no tensor ring, so this row is
# the cost alone, against mock_8b's 1F1B row; the gain needs a node.
LIMIT[mock_8b_gathered]=65; CMD[mock_8b_gathered]="$MOCK recipe=llama3_8b \
  parallel.remat=save_dots_gathered --schedules 1f1b --stage last --steps 2"
# The layout the verified planner picks for the 8B node (tools/plan.py recipe=llama3_8b
# --verify target=gpu:h100x8, 2026-12-03, with the gradient accumulation priced):
# pp2-dp2-tp2, interleaved over 8 chunks a rank, 4 microbatches of 4 x 4096, ZeRO-1:
# predicted 1607 ms a step against the recipe's 1775 (pp2-tp4 1F1B: its bubble 11.1%
# against 3.0%, four tensor devices' rings against two), 56.5 GiB compiled per H100.
# Its chunks are 2 layers: whether its cells run at the measured stages' rate is what
# this row says, against mock_8b's 1F1B row (MFU: model FLOPs per device). (16
# microbatches, the pick before the accumulation was priced: 96 ms of it a step.)
LIMIT[mock_8b_planned]=85; CMD[mock_8b_planned]="$MOCK recipe=llama3_8b parallel.data=2 \
  parallel.tensor=2 parallel.microbatches=4 --schedules interleaved_1f1b:8 --stage last --steps 2"
# The one-GPU bench with XLA's dynamic-slice fusion on: a cuBLAS GEMM may then write its
# output straight into the layer scan's residual stack, where the program copies it
# there now (gate_up and the gated product: 42 of its 535 GiB a step read and written,
# the GPU compiler's count, whose deviceless GEMMs are Triton fusions the flag leaves
# alone, 2026-12-03). Against bench's row: about 2% of the step at most.
LIMIT[bench_dsf]=90; CMD[bench_dsf]="XLA_FLAGS='--xla_gpu_enable_dynamic_slice_fusion=true' \
  $BENCH recipe=llama_1b_1gpu devices.platform=gpu --no-defaults --pairs 4 --rounds 2 --attention ''"
# Part 1, the most important first: the fused ring's numbers (the shipped 128k recipe's
# correctness), the changed 8B stage, the one-GPU levers, FP8's speed-up (500 s of limits).
# Part 2: the 128k stage with either ring, the 1B stages (540 s). Part 3: the rest (670 s
# of limits: the FP8 statistics' and the dynamic-slice fusion's rows last, skipped if
# the others take theirs;
# mock_8b_gathered by STEPS= only: save_dots_gathered is dominated since save_dots
# gathers again beside its matmuls).
PART1=ring_pieces,mock_8b,bench_dots28,mock_8b_fp8,mock_8b_fp8_delayed
PART2=mock_128k,mock_128k_blockwise,mock_1b,mock_1b_none
PART3=bench,bench_fp8,mock_1b_full,mock_8b_full,mock_8b_planned,mock_moe,mock_8b_fp8_nostats,bench_dsf
ONLY=mock_8b_gathered  # by STEPS= only
case "${PART:-1}" in 1) DEFAULT=$PART1 ;; 2) DEFAULT=$PART2 ;; 3) DEFAULT=$PART3 ;;
  *) echo "PART=${PART}: 1, 2 or 3"; exit 2 ;; esac
BUDGET=${BUDGET:-560}
whole() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
whole "$BUDGET" || { echo "BUDGET=$BUDGET: whole seconds, above 0"; exit 2; }
IFS=, read -r -a CHOSEN <<< "${STEPS:-$DEFAULT}"
for k in "${!CHOSEN[@]}"; do
  name=${CHOSEN[$k]//[[:space:]]/}; CHOSEN[$k]=$name
  [ -n "$name" ] && [ -n "${CMD[$name]:-}" ] || {
    echo "STEPS: no step '$name' (one of $PART1,$PART2,$PART3,$ONLY)"; exit 2; }
  override="LIMIT_$name"
  whole "${!override:-${LIMIT[$name]}}" || {
    echo "$override=${!override}: whole seconds, above 0"; exit 2; }
done
for name in "${CHOSEN[@]}"; do
  override="LIMIT_$name"; secs=${!override:-${LIMIT[$name]}}
  if [ $((SECONDS + secs)) -gt "$BUDGET" ]; then
    echo "== $name skipped: its $secs s would end past the call's budget ($BUDGET s, $SECONDS s used)" \
      | tee -a "$OUT/device_check.log"; continue
  fi
  step "$name" "$secs" bash -c "${CMD[$name]}"
done
exit 0
