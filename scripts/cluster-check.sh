#!/usr/bin/env bash
# The MPI build of tinyllm across two "hosts" (network namespaces, see netns-cluster.sh),
# talking TCP as across machines:
#   1. every data-, tensor- and pipeline-parallel layout trains what one process trains,
#      byte for byte (the weights of the last checkpoint);
#   2. a host whose link goes down mid-run ends the run within the MPI backend's timeout,
#      with an error naming the ranks and hosts, no rank left running on either host, and
#      the last checkpoint resumes.
# Usage: scripts/cluster-check.sh TINYLLM   (a build with --features mpi)
# Exits 0 with a visible SKIP line where a cluster cannot be made (not root, no ip netns).
set -euo pipefail

tinyllm="$(realpath "${1:?usage: cluster-check.sh TINYLLM}")"
here="$(cd "$(dirname "$0")" && pwd)"
cluster="$here/netns-cluster.sh"
runs="$(mktemp -d)"
trap 'rm -rf "$runs"' EXIT

probe=0
"$cluster" -n 2 -- true 2>"$runs/probe" || probe=$?
if [ "$probe" = 3 ]; then
    echo "SKIP cluster-check: $(cat "$runs/probe")"
    exit 0
fi
[ "$probe" = 0 ] || { cat "$runs/probe" >&2; exit 1; }

# The harness itself: bad arguments, the command's status, and nothing left behind on any
# way out, a signal included.
leftovers() { ip netns list | grep -c "^tl$1-" || true; }
status=0
"$cluster" -n 5 -- true 2>/dev/null || status=$?
[ "$status" = 2 ] || { echo "FAIL cluster-check: -n 5 gave status $status, not 2" >&2; exit 1; }
status=0
"$cluster" -n 3 -- sh -c 'echo "$TL_CLUSTER_NS" >"$0"; exit 7' "$runs/names" || status=$?
[ "$status" = 7 ] || { echo "FAIL cluster-check: the command's status 7 came back as $status" >&2; exit 1; }
[ "$(wc -w <"$runs/names")" = 3 ] || { echo "FAIL cluster-check: not 3 hosts" >&2; exit 1; }
"$cluster" -n 2 -- sleep 600 &
harness=$!
for _ in $(seq 100); do
    [ "$(leftovers $harness)" -gt 0 ] && break
    sleep 0.1
done
kill -TERM $harness
status=0
wait $harness || status=$?
[ "$status" = 143 ] || { echo "FAIL cluster-check: SIGTERM gave status $status" >&2; exit 1; }
[ "$(leftovers $harness)" = 0 ] || { echo "FAIL cluster-check: namespaces left" >&2; exit 1; }
for ns in $(cat "$runs/names"); do
    ! ip netns list | grep -qw "$ns" || { echo "FAIL cluster-check: $ns left" >&2; exit 1; }
done
echo "ok   cluster-check: the harness refuses bad sizes, passes the status on, leaves nothing"

tiny=(train --preset tiny --micro-batch 2 --corpus-bytes 40000 --steps 3 --quiet)
last=checkpoint-000003/model.safetensors

# Each layout on two hosts against the same run elsewhere, byte for byte: one process on the
# same global batch (accum 2 in one process is accum 1 on each of two data-parallel ranks),
# or, for tensor parallelism, whose sums are split across the ranks, the same two ranks on
# one machine over the socket ring. The reduction overlaps backward (the default) but in the
# second line, which reduces after backward.
layouts=(
    "--accum 1|--accum 2"
    "--accum 1 --overlap=false|--accum 2"
    "--accum 1 --zero 1|--accum 2"
    "--accum 1 --zero 2 --no-clip|--accum 2 --no-clip"
    "--accum 1 --zero 3 --no-clip|--accum 2 --no-clip"
    "--accum 2 --tp 2|launch -n 2 -- --accum 2 --tp 2"
    "--accum 2 --pp 2|--accum 2"
)
for pair in "${layouts[@]}"; do
    layout="${pair%%|*}"
    reference="${pair#*|}"
    name="$(echo "$layout" | tr -d ' -')"
    # shellcheck disable=SC2086
    timeout 300 "$cluster" -n 2 -- sh -c "\"\$TL_CLUSTER_MPIRUN\" -np 2 \"$tinyllm\" ${tiny[*]} \
        $layout --backend mpi --out $runs/two-$name" >"$runs/log-$name" 2>&1 \
        || { cat "$runs/log-$name" >&2; echo "FAIL cluster-check: $layout on 2 hosts" >&2; exit 1; }
    case "$reference" in
        launch*) command=(launch -n 2 -- "${tiny[@]}" ${reference#launch -n 2 -- }) ;;
        *) command=("${tiny[@]}" $reference) ;;
    esac
    timeout 300 "$tinyllm" "${command[@]}" --out "$runs/ref-$name" >"$runs/ref-log-$name" 2>&1 \
        || { cat "$runs/ref-log-$name" >&2; echo "FAIL cluster-check: tinyllm ${command[*]}" >&2; exit 1; }
    cmp "$runs/two-$name/$last" "$runs/ref-$name/$last" \
        || { echo "FAIL cluster-check: $layout on 2 hosts is not tinyllm ${command[*]}" >&2; exit 1; }
    echo "ok   cluster-check: $layout on 2 hosts = tinyllm ${command[*]}, byte for byte"
done

# mpirun's default binding puts each host's one rank on one core: rank 0 says so, once,
# with the flags that give a rank its node; with --bind-to none it says nothing.
warning="warning: mpirun bound every rank (2) to fewer cores than its node's ranks could use"
[ "$(grep -c "$warning" "$runs/log-accum1")" = 1 ] \
    || { cat "$runs/log-accum1" >&2; echo "FAIL cluster-check: no binding warning" >&2; exit 1; }
timeout 300 "$cluster" -n 2 -- sh -c "\"\$TL_CLUSTER_MPIRUN\" -np 2 --bind-to none \"$tinyllm\" \
    ${tiny[*]} --accum 1 --backend mpi --out $runs/unbound" >"$runs/log-unbound" 2>&1 \
    || { cat "$runs/log-unbound" >&2; echo "FAIL cluster-check: --bind-to none" >&2; exit 1; }
! grep -q "warning: mpirun bound" "$runs/log-unbound" \
    || { cat "$runs/log-unbound" >&2; echo "FAIL cluster-check: a warning with --bind-to none" >&2; exit 1; }
echo "ok   cluster-check: the default binding is named once, --bind-to none is not"

# A link taken down mid-run. Each rank gives up after TINYLLM_COMM_TIMEOUT_MS of one call.
timeout_ms=4000
out="$runs/cut"
started=""
cut_run() {
    TINYLLM_COMM_TIMEOUT_MS=$timeout_ms "$TL_CLUSTER_MPIRUN" -np 2 -x TINYLLM_COMM_TIMEOUT_MS \
        "$tinyllm" train --preset tiny --micro-batch 2 --corpus-bytes 40000 --steps 100000 \
        --accum 1 --save-interval 5 --eval-interval 100000 --quiet --backend mpi \
        --out "$out" >"$runs/cut.log" 2>&1 &
    local job=$!
    # Wait for a checkpoint, then cut host 1 off the switch.
    for _ in $(seq 600); do
        [ -d "$out/checkpoint-000005" ] && break
        sleep 0.1
    done
    [ -d "$out/checkpoint-000005" ] || { echo "no checkpoint came" >&2; kill $job; return 1; }
    local link1="${TL_CLUSTER_LINK#* }"
    ip netns exec "$TL_CLUSTER_SWITCH" ip link set "$link1" down
    local cut_at=$SECONDS
    # Every rank, on both hosts, must end by its own watchdog: mpirun cannot reach the
    # host that was cut off, to end its rank for it.
    local deadline=$((timeout_ms / 1000 + 30)) ns pid left=x
    while [ -n "$left" ] && [ $((SECONDS - cut_at)) -le "$deadline" ]; do
        left=""
        for ns in $TL_CLUSTER_NS; do
            for pid in $(ip netns pids "$ns"); do
                if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = tinyllm ]; then
                    left="$left $ns:$pid"
                fi
            done
        done
        [ -z "$left" ] || sleep 0.2
    done
    local took=$((SECONDS - cut_at))
    echo "every rank had ended ${took} s after the cut"
    # mpirun itself waits on for the daemon it lost (Open MPI's TCP gives up after many
    # minutes): a user stops it with a second Ctrl-C, as it says.
    kill -INT $job 2>/dev/null || true
    sleep 1
    kill -KILL $job 2>/dev/null || true
    wait $job 2>/dev/null || true
    [ -z "$left" ] || { echo "ranks still running ${took} s after the cut:$left" >&2; return 1; }
}
export -f cut_run
export tinyllm out runs timeout_ms
timeout 300 "$cluster" -n 2 -- bash -c cut_run \
    || { cat "$runs/cut.log" >&2; echo "FAIL cluster-check: a link down mid-run" >&2; exit 1; }
grep -q "no answer came within" "$runs/cut.log" \
    || { cat "$runs/cut.log" >&2; echo "FAIL cluster-check: no timeout error named the call" >&2; exit 1; }
grep -E "error: rank [01] of 2 on tl[0-9]+-h[01] .*waiting for rank [01] on tl[0-9]+-h[01]" "$runs/cut.log" | head -2
echo "ok   cluster-check: a link down ends the run within the timeout, naming ranks and hosts"

# The last checkpoint resumes, on two hosts again.
before="$(head -n 1 "$out/LATEST")"
timeout 300 "$cluster" -n 2 -- sh -c "\"\$TL_CLUSTER_MPIRUN\" -np 2 \"$tinyllm\" train --resume $out \
    --until-step $((10#${before#checkpoint-} + 2)) --quiet --backend mpi" >"$runs/resume.log" 2>&1 \
    || { cat "$runs/resume.log" >&2; echo "FAIL cluster-check: the resume" >&2; exit 1; }
echo "ok   cluster-check: $before resumed and trained 2 more steps"
