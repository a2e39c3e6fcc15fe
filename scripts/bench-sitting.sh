#!/bin/bash
# One sitting of docs/benchmarks.md's current figures: tinyllm bench and the PyTorch peers,
# alternating, twice each, on the capstone. About 20 minutes on 2 cores with an AVX2-only CPU
# (PyTorch's bf16 takes a minute per step there; SKIP_PT_BF16=1 leaves it out).
#
#   TINYLLM=target/release/tinyllm PEERS=../shared/peers PYTHON=~/venvs/torch/bin/python \
#     scripts/bench-sitting.sh bench-out
#
# Each figure is one JSON file in the output directory (tinyllm's `bench --json`, the peers'
# one line).
set -u
T=${TINYLLM:-target/release/tinyllm}
P=${PEERS:-../shared/peers}
PY=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
O=${1:-bench-out}
mkdir -p "$O"
date -u +%FT%TZ > "$O/start"
CAP=(--preset capstone --micro-batch 8 --accum 1)
for round in 1 2; do
  for recipe in fp32 bf16 fp16 fp32+ckpt bf16+ckpt; do
    flags=()
    case $recipe in bf16*) flags+=(--bf16) ;; fp16) flags+=(--fp16) ;; esac
    case $recipe in *+ckpt) flags+=(--checkpoint-activations) ;; esac
    "$T" bench "${CAP[@]}" "${flags[@]}" --steps 5 --json > "$O/tl-$recipe-$round.json"
  done
  "$PY" "$P/cpu_bench.py" fp32 0 8 1 capstone > "$O/pt-fp32-$round.json"
  "$PY" "$P/cpu_bench.py" fp32 1 8 1 capstone > "$O/pt-fp32+ckpt-$round.json"
  [ -n "${SKIP_PT_BF16:-}" ] || "$PY" "$P/cpu_bench.py" bf16 0 8 1 capstone > "$O/pt-bf16-$round.json"
done
"$T" bench "${CAP[@]}" --paired fp32,bf16 --steps 12 --json > "$O/tl-paired-fp32-bf16.json"
"$T" bench "${CAP[@]}" --paired fp32,fp32+ckpt --steps 8 --json > "$O/tl-paired-fp32-fp32+ckpt.json"
"$T" bench "${CAP[@]}" --paired bf16,bf16+ckpt --steps 8 --json > "$O/tl-paired-bf16-bf16+ckpt.json"
for round in 1 2; do
  for mode in fp32 bf16; do
    flags=()
    [ $mode = bf16 ] && flags+=(--bf16)
    "$T" launch -n 2 -- bench --preset capstone --micro-batch 4 --accum 1 "${flags[@]}" --steps 5 --json \
      > "$O/tl-ddp-$mode-$round.json"
    [ $mode = bf16 ] && [ -n "${SKIP_PT_BF16:-}" ] && continue
    OMP_NUM_THREADS=1 "$TORCHRUN" --nproc_per_node=2 "$P/ddp_bench.py" $mode 4 1 > "$O/pt-ddp-$mode-$round.json"
  done
done
date -u +%FT%TZ > "$O/end"
