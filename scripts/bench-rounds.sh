#!/bin/bash
# Issue 38's two targets against PyTorch, measured in interleaved rounds: the bf16 capstone
# step against PyTorch's bf16 autocast (2 threads each), and two ranks of one thread against
# PyTorch DDP. A shared machine drifts by ±15% within minutes, so one round says little:
# each round runs the four commands back to back, and the summary gives every round's
# ratio, their median, the lowest, and the ratio of each side's best step. About 75 s a
# round on 2 cores. On a CPU with AMX tiles, each round also runs the bf16 step in the tiles'
# order (`--accumulate amx`, what PyTorch's bf16 products compute there) against the same
# PyTorch figure. And each round times the fp32 step with its GEMM limit (`--gemm-limit`: the
# step's own products, each timed alone), for the fraction of the limit the step reaches.
#
#   TINYLLM=target/release/tinyllm PEERS=../shared/peers PYTHON=python3 \
#     scripts/bench-rounds.sh bench-rounds-out 10
#
# Each figure is one JSON file in the output directory (tinyllm's `bench --json`, the peers'
# one line); `summary.md` holds the table.
set -u
T=${TINYLLM:-target/release/tinyllm}
P=${PEERS:-../shared/peers}
PY=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-$(dirname "$(command -v "$PY")")/torchrun}
O=${1:-bench-rounds-out}
N=${2:-10}
mkdir -p "$O"
date -u +%FT%TZ > "$O/start"
AMX=$("$T" bench --preset tiny --steps 1 --warmup 1 --json | grep -c '"amx-bf16"')
for round in $(seq 1 "$N"); do
  "$T" bench --preset capstone --micro-batch 8 --accum 1 --bf16 --steps 3 --warmup 1 --json \
    > "$O/tl-bf16-$round.json"
  if [ "$AMX" -gt 0 ]; then
    "$T" bench --preset capstone --micro-batch 8 --accum 1 --bf16 --accumulate amx --steps 3 \
      --warmup 1 --json > "$O/tl-amx-$round.json"
  fi
  "$PY" "$P/cpu_bench.py" bf16 0 8 1 capstone > "$O/pt-bf16-$round.json"
  "$T" launch -n 2 -- bench --preset capstone --micro-batch 4 --accum 1 --steps 3 --warmup 1 \
    --json > "$O/tl-ddp-$round.json"
  OMP_NUM_THREADS=1 "$TORCHRUN" --nproc_per_node=2 "$P/ddp_bench.py" fp32 4 1 \
    > "$O/pt-ddp-$round.json"
  "$T" bench --preset capstone --micro-batch 8 --accum 1 --steps 3 --warmup 1 --gemm-limit \
    --json > "$O/tl-limit-$round.json"
done
date -u +%FT%TZ > "$O/end"
"$PY" - "$O" "$N" <<'EOF' | tee "$O/summary.md"
import json, os, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])

def tinyllm(path):
    with open(path) as f:
        return json.load(f)["recipes"][0]["seconds"]["median"]

def pytorch(path):
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])["step_s"]

for kind, peer, title in [
        ("bf16", "bf16", "bf16, 2 threads (PyTorch: autocast)"),
        ("amx", "bf16", "bf16 in the AMX tiles' order, 2 threads (PyTorch: autocast)"),
        ("ddp", "ddp", "two ranks of one thread, fp32 (PyTorch: DDP)")]:
    if not os.path.exists(f"{out}/tl-{kind}-1.json"):
        continue
    pairs = [(tinyllm(f"{out}/tl-{kind}-{r}.json"), pytorch(f"{out}/pt-{peer}-{r}.json"))
             for r in range(1, rounds + 1)]
    ratios = [pt / tl for tl, pt in pairs]
    print(f"\n{title}\n\n| round | tinyllm, s | PyTorch, s | ratio |\n|---|---|---|---|")
    for r, ((tl, pt), ratio) in enumerate(zip(pairs, ratios), 1):
        print(f"| {r} | {tl:.3f} | {pt:.3f} | {ratio:.2f}× |")
    best = min(pt for _, pt in pairs) / min(tl for tl, _ in pairs)
    print(f"\nratio: median {statistics.median(ratios):.2f}×, lowest {min(ratios):.2f}×, "
          f"highest {max(ratios):.2f}×; best step against best step {best:.2f}×")

print("\nfp32, 2 threads, against the GEMM limit of its own products\n")
print("| round | step, s | limit, s | fraction |\n|---|---|---|---|")
fractions = []
for r in range(1, rounds + 1):
    with open(f"{out}/tl-limit-{r}.json") as f:
        report = json.load(f)
    step, limit = report["recipes"][0]["seconds"]["median"], report["gemm_limit"]["seconds"]
    fractions.append(limit / step)
    print(f"| {r} | {step:.3f} | {limit:.3f} | {100 * limit / step:.1f}% |")
print(f"\nfraction: median {100 * statistics.median(fractions):.1f}%, "
      f"lowest {100 * min(fractions):.1f}%, highest {100 * max(fractions):.1f}%")
EOF
