#!/usr/bin/env bash
# A cluster of hosts on this machine (issue 33): Linux network namespaces joined by a bridge.
#
#   cluster/cluster.sh up                      # hosts a b c d, each with its own address and loopback
#   cluster/cluster.sh exec HOST -- CMD...     # run CMD on HOST (foreground)
#   cluster/cluster.sh spawn HOST NAME -- CMD  # run CMD on HOST in the background (log: HOST's /tmp/NAME.log)
#   cluster/cluster.sh kill HOST               # kill every process on HOST (a host lost)
#   cluster/cluster.sh down                    # kill everything, remove the namespaces and the hosts' files
#   cluster/cluster.sh status                  # hosts, addresses, processes
#
# Needs root, iproute2 and util-linux (unshare). Nothing in the machine's own network namespace is
# touched: the bridge lives in a namespace of its own ($CLUSTER-net), and every veth pair is created
# there with its other end put straight into a host's namespace.
#
# What a host has of its own, as a host of a real cluster would:
#   - an address on the bridge (10.77.0.1 a, .2 b, .3 c, .4 d: CLOTHO_CLUSTER_SUBNET changes 10.77.0)
#     and its own loopback; the hosts reach each other by name (clotho-a ...: its /etc/hosts);
#   - its hostname (UTS namespace), its /tmp (HOME=/tmp/home, caches, Prefect home, work dirs),
#     its /dev/shm;
#   - the checkout mounted read-only (the image every host runs: code and venvs), and the cluster's
#     root hidden, so no host sees another's files. What hosts share is what they reach over the
#     bridge: object storage (the S3 API on a), the Prefect API, the policy server's HTTP API.
#
# CLOTHO_CLUSTER names the cluster (default clotho: namespaces clotho-a ... clotho-net), so tests
# can bring up their own; CLOTHO_CLUSTER_ROOT is where hosts' files live (default /var/tmp/$CLUSTER).
set -euo pipefail

CLUSTER=${CLOTHO_CLUSTER:-clotho}
ROOT=${CLOTHO_CLUSTER_ROOT:-/var/tmp/$CLUSTER}
SUBNET=${CLOTHO_CLUSTER_SUBNET:-10.77.0}
HOSTS=(a b c d)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NET=$CLUSTER-net

die() { echo "cluster: $*" >&2; exit 2; }
address() {  # address HOST
    local i
    for i in "${!HOSTS[@]}"; do [[ ${HOSTS[$i]} == "$1" ]] && { echo "$SUBNET.$((i + 1))"; return; }; done
    die "no host '$1'; the hosts are ${HOSTS[*]}"
}
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }

up() {
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces)"
    exists "$NET" && die "$CLUSTER is already up (cluster/cluster.sh down first)"
    mkdir -p "$ROOT"
    : > "$ROOT/hosts"
    printf '127.0.0.1 localhost\n' >> "$ROOT/hosts"
    for host in "${HOSTS[@]}"; do printf '%s %s-%s\n' "$(address "$host")" "$CLUSTER" "$host" >> "$ROOT/hosts"; done
    ip netns add "$NET"
    ip -n "$NET" link set lo up
    ip -n "$NET" link add br0 type bridge
    ip -n "$NET" link set br0 up
    for host in "${HOSTS[@]}"; do
        ip netns add "$CLUSTER-$host"
        ip -n "$NET" link add "port-$host" type veth peer name eth0 netns "$CLUSTER-$host"
        ip -n "$NET" link set "port-$host" master br0 up
        ip -n "$CLUSTER-$host" addr add "$(address "$host")/24" dev eth0
        ip -n "$CLUSTER-$host" link set eth0 up
        ip -n "$CLUSTER-$host" link set lo up
        mkdir -p "$ROOT/$host/tmp/home" "$ROOT/$host/shm" "$ROOT/$host/repo"
        chmod 1777 "$ROOT/$host/tmp"
    done
    echo "cluster $CLUSTER up: $(for host in "${HOSTS[@]}"; do printf '%s-%s=%s ' "$CLUSTER" "$host" "$(address "$host")"; done)"
}

# The command line that runs "$@" on a host: its network namespace, then a mount and UTS namespace
# of its own where /tmp, /dev/shm, /etc/hosts and the hostname are the host's, the checkout is
# read-only and the cluster's root is hidden. The checkout is held aside while /tmp is replaced and
# put back at its path after, so a checkout that lives in /tmp (a CI clone) is still there.
on_host() {  # on_host HOST CMD...
    local host=$1; shift
    address "$host" > /dev/null
    exists "$CLUSTER-$host" || die "$CLUSTER-$host is not up (cluster/cluster.sh up)"
    local setup='set -e
hostname "$CLUSTER_HOSTNAME"
mount --bind "$REPO" "$HOST_DIR/repo"
mount --bind "$HOST_DIR/tmp" /tmp
mount --bind "$HOST_DIR/shm" /dev/shm
mount --bind "$CLUSTER_ROOT/hosts" /etc/hosts
mkdir -p "$REPO"
mount --move "$HOST_DIR/repo" "$REPO"
mount -o remount,bind,ro "$REPO"
mount -t tmpfs -o size=1m,mode=0755 none "$CLUSTER_ROOT"
cd /tmp
exec "$@"'
    exec ip netns exec "$CLUSTER-$host" unshare --mount --uts --propagation private -- \
        env -i PATH="$REPO/.venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin" HOME=/tmp/home TMPDIR=/tmp \
        XDG_CACHE_HOME=/tmp/home/.cache PREFECT_HOME=/tmp/home/.prefect LANG=C.UTF-8 PYTHONUNBUFFERED=1 \
        CLUSTER_HOSTNAME="$CLUSTER-$host" HOST_DIR="$ROOT/$host" CLUSTER_ROOT="$ROOT" REPO="$REPO" \
        CLOTHO_CLUSTER_HOST="$host" CLOTHO_CLUSTER_ADDRESS="$(address "$host")" \
        bash -c "$setup" bash "$@"
}

kill_host() {  # every process in the host's network namespace, then its leftovers
    local host=$1 pids
    exists "$CLUSTER-$host" || return 0
    for _ in 1 2 3 4 5; do
        pids=$(ip netns pids "$CLUSTER-$host")
        [[ -z $pids ]] && return 0
        kill -9 $pids 2> /dev/null || true
        sleep 0.2
    done
    [[ -z $(ip netns pids "$CLUSTER-$host") ]] || die "processes left on $CLUSTER-$host: $(ip netns pids "$CLUSTER-$host" | tr '\n' ' ')"
}

down() {
    for host in "${HOSTS[@]}"; do kill_host "$host"; exists "$CLUSTER-$host" && ip netns del "$CLUSTER-$host"; done
    exists "$NET" && ip netns del "$NET"
    rm -rf "$ROOT"
    echo "cluster $CLUSTER down"
}

status() {
    for host in "${HOSTS[@]}"; do
        if exists "$CLUSTER-$host"; then
            echo "$CLUSTER-$host $(address "$host"): $(ip netns pids "$CLUSTER-$host" | wc -l) processes"
        else
            echo "$CLUSTER-$host: down"
        fi
    done
}

command=${1:-}; shift || true
case $command in
    up) up ;;
    down) down ;;
    status) status ;;
    address) address "$1" ;;
    kill) kill_host "$1" ;;
    exec)
        host=$1; shift; [[ ${1:-} == -- ]] && shift
        [[ $# -gt 0 ]] || die "exec HOST -- CMD: no command"
        on_host "$host" "$@" ;;
    spawn)
        host=$1 name=$2; shift 2; [[ ${1:-} == -- ]] && shift
        [[ $# -gt 0 ]] || die "spawn HOST NAME -- CMD: no command"
        [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "spawn: the name '$name' must be letters, digits, . _ -"
        log="$ROOT/$host/tmp/$name.log"
        ( on_host "$host" "$@" ) > "$log" 2>&1 < /dev/null &
        echo $! > "$ROOT/$host/tmp/$name.pid"
        echo "$name on $CLUSTER-$host: pid $!, log $log" ;;
    *) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; [[ -z $command ]] || exit 2 ;;
esac
