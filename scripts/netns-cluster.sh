#!/usr/bin/env bash
# A cluster of N "hosts" on this machine: each host a network namespace of its own (its own
# hostname too) with one link, eth0, to a switch (a bridge in a namespace of its own), and
# Open MPI launching across them over TCP, as mpirun does across machines. Links can be
# slowed (a rate, and a delay where the kernel has netem) and taken down mid-run. Nothing
# is added to the machine's own network: the addresses (10.213.0.0/24) exist only inside
# the cluster's namespaces, and everything is removed on every way out of this script.
#
# Usage: scripts/netns-cluster.sh [-n HOSTS] [--slots S] [--rate RATE] [--delay MS] -- COMMAND...
#
# COMMAND runs in the machine's own namespace with these in its environment:
#   TL_CLUSTER_MPIRUN   a program to use as mpirun: runs mpirun on host 0 with the
#                       cluster's hostfile, agent and TCP interfaces (add -np and the rest)
#   TL_CLUSTER_HOSTS    the hosts' addresses, space-separated (host 0 first)
#   TL_CLUSTER_NS       the hosts' namespaces, space-separated
#   TL_CLUSTER_LINK     the hosts' links on the switch's side, space-separated:
#                       `ip netns exec $TL_CLUSTER_SWITCH ip link set LINK down` cuts a host off
#   TL_CLUSTER_SWITCH   the switch's namespace
#   TL_CLUSTER_DIR      a directory with the hostfile and the agent
# It exits with COMMAND's status; 2 for bad arguments; 3 where the cluster cannot be made
# here (not root, no `ip netns`, no mpirun), with the reason on stderr.
set -euo pipefail

hosts=2
slots=1
rate=""
delay=""
usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        -n | --hosts) hosts="${2:?}"; shift 2 ;;
        --slots) slots="${2:?}"; shift 2 ;;
        --rate) rate="${2:?}"; shift 2 ;;
        --delay) delay="${2:?}"; shift 2 ;;
        --) shift; break ;;
        -h | --help) usage ;;
        *) echo "netns-cluster: unknown option $1" >&2; usage ;;
    esac
done
[ $# -gt 0 ] || { echo "netns-cluster: no command after --" >&2; usage; }
case "$hosts" in 2 | 3 | 4) ;; *) echo "netns-cluster: -n takes 2 to 4 hosts, not $hosts" >&2; exit 2 ;; esac
case "$slots" in '' | *[!0-9]* | 0) echo "netns-cluster: --slots takes a positive count, not $slots" >&2; exit 2 ;; esac
case "$delay" in '' | [0-9]*) ;; *) echo "netns-cluster: --delay takes milliseconds, not $delay" >&2; exit 2 ;; esac

cannot() { echo "netns-cluster: cannot make a cluster here: $*" >&2; exit 3; }
[ "$(id -u)" = 0 ] || cannot "network namespaces need root"
command -v ip >/dev/null || cannot "no ip (iproute2)"
command -v mpirun >/dev/null || cannot "no mpirun (Open MPI)"
command -v unshare >/dev/null || cannot "no unshare (util-linux)"

# Names unique to this cluster, so that several can exist at once; interface names stay
# within the kernel's 15 characters.
id="tl$$"
switch="$id-sw"
dir="$(mktemp -d "${TMPDIR:-/tmp}/netns-cluster.XXXXXX")"
namespaces=()
links=()
addresses=()

command_pid=""
cleanup() {
    local status=$?
    trap - EXIT INT TERM HUP
    if [ -n "$command_pid" ]; then
        kill -TERM "$command_pid" 2>/dev/null || true
        wait "$command_pid" 2>/dev/null || true
    fi
    # Every process left in a host (an orted, a rank), then the namespaces: their links go
    # with them.
    for ns in "${namespaces[@]}" "$switch"; do
        if ip netns list | grep -qw "$ns"; then
            ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
    rm -rf "$dir"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

ip netns add "$switch" || cannot "ip netns add failed"
ip -n "$switch" link set lo up
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up

# The link's shaping, on both ends so both directions are limited: netem carries a rate
# and a delay; tbf (where the kernel has no netem) a rate only.
shape() {
    local ns="$1" dev="$2"
    [ -n "$rate$delay" ] || return 0
    local netem=(netem)
    [ -n "$delay" ] && netem+=(delay "${delay}ms")
    [ -n "$rate" ] && netem+=(rate "$rate")
    if ip netns exec "$ns" tc qdisc add dev "$dev" root "${netem[@]}" 2>/dev/null; then
        return 0
    fi
    [ -z "$delay" ] || cannot "--delay needs netem, which this kernel does not have (tbf can only limit the rate)"
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency 50ms \
        || cannot "tc could not limit $dev to $rate"
}

for ((h = 0; h < hosts; h++)); do
    ns="$id-h$h"
    link="${id}v$h"
    address="10.213.0.$((h + 1))"
    ip netns add "$ns"
    namespaces+=("$ns")
    ip link add "$link" netns "$switch" type veth peer name eth0 netns "$ns"
    ip -n "$switch" link set "$link" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$address/24" dev eth0
    ip -n "$ns" link set eth0 up
    shape "$ns" eth0
    shape "$switch" "$link"
    links+=("$link")
    addresses+=("$address")
    echo "$address slots=$slots" >>"$dir/hostfile"
done

# Open MPI's rsh agent: `AGENT [OPTIONS] HOST COMMAND...`. It enters the host's namespace,
# under a hostname of its own, so Open MPI sees separate nodes and talks TCP between them.
{
    echo '#!/bin/sh'
    echo 'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done'
    echo 'host="$1"; shift'
    echo 'case "$host" in'
    for ((h = 0; h < hosts; h++)); do
        echo "    ${addresses[$h]}) ns=${namespaces[$h]} ;;"
    done
    echo '    *) echo "netns-cluster agent: no host $host" >&2; exit 255 ;;'
    echo 'esac'
    echo 'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns; $*"'
} >"$dir/agent"
chmod +x "$dir/agent"

# mpirun on host 0, as a user logged in there would run it.
{
    echo '#!/bin/sh'
    echo "exec ip netns exec ${namespaces[0]} unshare --uts sh -c 'hostname ${namespaces[0]}; exec \"\$0\" \"\$@\"' \\"
    echo "    mpirun --allow-run-as-root --oversubscribe --hostfile $dir/hostfile \\"
    echo "    --mca plm_rsh_agent $dir/agent --mca btl tcp,self \\"
    echo "    --mca btl_tcp_if_include 10.213.0.0/24 --mca oob_tcp_if_include 10.213.0.0/24 \"\$@\""
} >"$dir/mpirun"
chmod +x "$dir/mpirun"

export TL_CLUSTER_MPIRUN="$dir/mpirun"
export TL_CLUSTER_HOSTS="${addresses[*]}"
export TL_CLUSTER_NS="${namespaces[*]}"
export TL_CLUSTER_LINK="${links[*]}"
export TL_CLUSTER_SWITCH="$switch"
export TL_CLUSTER_DIR="$dir"
# In the background, so that a signal to this script is handled at once (bash runs a
# trap only once a foreground child has finished), and the command is ended with the
# cluster.
"$@" &
command_pid=$!
set +e
wait "$command_pid"
status=$?
set -e
command_pid=""
exit "$status"
