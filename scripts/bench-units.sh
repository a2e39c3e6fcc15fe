#!/bin/bash
# One sitting of docs/benchmarks.md's "Hardware units" figures (issue 38): the capstone step
# in fp32, bf16 (on the CPU's bf16 units where it has them), bf16 on the H100 model and fp8,
# bf16 in the AMX tiles' order where the CPU has them,
# PyTorch's fp32 and bf16 autocast beside them, the bf16/fp32 cost paired, and two ranks
# against PyTorch DDP. About 15 minutes on 2 cores.
#
#   TINYLLM=target/release/tinyllm PEERS=../shared/peers PYTHON=python3 \
#     scripts/bench-units.sh bench-units-out
#
# Each figure is one JSON file in the output directory (tinyllm's `bench --json`, the peers'
# one line).
set -u
T=${TINYLLM:-target/release/tinyllm}
P=${PEERS:-../shared/peers}
PY=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-$(dirname "$(command -v "$PY")")/torchrun}
O=${1:-bench-units-out}
mkdir -p "$O"
date -u +%FT%TZ > "$O/start"
CAP=(--preset capstone --micro-batch 8 --accum 1)
for round in 1 2; do
  "$T" bench "${CAP[@]}" --steps 5 --json > "$O/tl-fp32-$round.json"
  "$T" bench "${CAP[@]}" --bf16 --steps 5 --json > "$O/tl-bf16-$round.json"
  "$T" bench "${CAP[@]}" --fp8 --steps 5 --json > "$O/tl-fp8-$round.json"
  "$PY" "$P/cpu_bench.py" fp32 0 8 1 capstone > "$O/pt-fp32-$round.json"
  "$PY" "$P/cpu_bench.py" bf16 0 8 1 capstone > "$O/pt-bf16-$round.json"
done
"$T" bench "${CAP[@]}" --bf16 --accumulate h100 --steps 2 --warmup 1 --json > "$O/tl-bf16-h100.json"
if "$T" bench --preset tiny --steps 1 --warmup 1 --json | grep -q '"amx-bf16"'; then
  # The AMX tiles' order, on them: twice, beside the bf16 figures above.
  for round in 1 2; do
    "$T" bench "${CAP[@]}" --bf16 --accumulate amx --steps 5 --json > "$O/tl-bf16-amx-$round.json"
  done
  "$T" bench "${CAP[@]}" --paired fp32,bf16+amx --steps 8 --json > "$O/tl-paired-fp32-amx.json"
fi
"$T" bench "${CAP[@]}" --paired fp32,bf16 --steps 8 --json > "$O/tl-paired-fp32-bf16.json"
"$T" bench "${CAP[@]}" --paired bf16,fp8 --steps 8 --json > "$O/tl-paired-bf16-fp8.json"
for round in 1 2; do
  "$T" launch -n 2 -- bench --preset capstone --micro-batch 4 --accum 1 --steps 5 --json \
    > "$O/tl-ddp-fp32-$round.json"
  OMP_NUM_THREADS=1 "$TORCHRUN" --nproc_per_node=2 "$P/ddp_bench.py" fp32 4 1 > "$O/pt-ddp-fp32-$round.json"
done
date -u +%FT%TZ > "$O/end"
