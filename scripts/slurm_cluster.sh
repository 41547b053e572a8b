#!/usr/bin/env bash
# A SLURM cluster on this machine, for the tests and for trying the SLURM profile: slurmctld,
# slurmd with two fake GPUs (the node `localhost`, partition `debug`), and slurmdbd on MariaDB so
# that `sacct` works as on a real site; and two more nodes of two fake GPUs each, `node1` and
# `node2` (partition `nodes`), each a slurmd in a network and host-name namespace of its own, with
# its own address on a bridge, so that a job across them is a job across two hosts as SLURM, srun
# and torch see it. Debian 12, as root.
#
#   scripts/slurm_cluster.sh install   # apt packages (about 25 s)
#   scripts/slurm_cluster.sh start     # a fresh cluster: config, daemons, no jobs or accounting
#                                      # left from an earlier start; waits for an idle node
#   scripts/slurm_cluster.sh stop      # stops each daemon by its pid file
#
# The account `demo` and the partitions `debug` and `nodes` exist on it. Everything lives under
# $STATE_DIR, but for the namespaces, the bridge and two lines of /etc/hosts (removed by stop).
set -euo pipefail

STATE_DIR=${VLFT_SLURM_STATE:-/var/lib/vlft-slurm}
CLUSTER=vlft
ACCOUNT=demo
PARTITION=debug
NODES_PARTITION=nodes
# The emulated nodes, name:address on the bridge, and the controller's address there.
EMULATED_NODES="node1:10.77.0.1 node2:10.77.0.2"
CONTROLLER_ADDRESS=10.77.0.254
BRIDGE=vlftbr0
PACKAGES="munge slurmctld slurmd slurm-client slurmdbd mariadb-server"

say() { echo "slurm_cluster: $*" >&2; }

wait_for() {  # wait_for <seconds> <what> <command...>
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq $((seconds * 5))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    say "timed out after ${seconds}s waiting for $what"
    diagnose
    return 1
}

diagnose() {  # what a failed start leaves to read: the node's state and the daemons' last words
    say "hostname $(hostname); sinfo: $(sinfo -h -N -o '%N %t %E' 2>&1 | tr '\n' ' ')"
    for log in "$STATE_DIR"/log/*.log; do
        [ -f "$log" ] || continue
        say "--- last lines of $log"
        tail -n 15 "$log" >&2
    done
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; then
        return 0
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
}

write_config() {
    local cpus mem_mb
    # At least 4 CPUs, so that two jobs of two threads run side by side even on a 2-core machine
    # (config_overrides lets slurmd accept more CPUs than it counts).
    cpus=$(( $(nproc) < 4 ? 4 : $(nproc) ))
    mem_mb=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    mkdir -p "$STATE_DIR"/{spool/ctld,spool/d/localhost,spool/d/node1,spool/d/node2,log,run,gpu} /etc/slurm
    chown -R slurm:slurm "$STATE_DIR"/spool "$STATE_DIR"/log "$STATE_DIR"/run
    # More CPUs than the machine has (see above): OpenMP threads of jobs that share a core must sleep
    # at their barriers, not spin, or each waits on the other's descheduled threads (training steps
    # measured 10 to 50 times slower). Every task of every job gets this from the task prolog.
    printf '#!/bin/sh\necho export OMP_WAIT_POLICY=PASSIVE\n' >"$STATE_DIR/task_prolog.sh"
    chmod 755 "$STATE_DIR/task_prolog.sh"
    # Fake GPUs: SLURM needs a device file per GPU and refuses plain files; /dev/null will do.
    ln -sf /dev/null "$STATE_DIR/gpu/nvidia0"
    ln -sf /dev/null "$STATE_DIR/gpu/nvidia1"

    cat >/etc/slurm/slurm.conf <<EOF
ClusterName=$CLUSTER
SlurmctldHost=localhost($CONTROLLER_ADDRESS)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE_DIR/spool/ctld
SlurmdSpoolDir=$STATE_DIR/spool/d/%n
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog=$STATE_DIR/task_prolog.sh
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
# Signals at the time limit: SIGTERM, then SIGKILL after KillWait seconds.
KillWait=30
# Keep finished jobs visible to squeue for a while, as real sites do.
MinJobAge=300
ReturnToService=2
SlurmdParameters=config_overrides
# The emulated nodes first: SLURM takes any name it looks up for a node named localhost while that
# is the only node it knows, and would find node1 "duplicated".
NodeName=node[1-2] NodeAddr=10.77.0.[1-2] CPUs=$cpus RealMemory=$mem_mb Gres=gpu:2 State=UNKNOWN
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:2 State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=$NODES_PARTITION Nodes=node[1-2] MaxTime=INFINITE State=UP
EOF
    cat >/etc/slurm/gres.conf <<EOF
NodeName=localhost Name=gpu File=$STATE_DIR/gpu/nvidia[0-1]
NodeName=node[1-2] Name=gpu File=$STATE_DIR/gpu/nvidia[0-1]
EOF
    cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
PidFile=$STATE_DIR/run/slurmdbd.pid
LogFile=$STATE_DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chown slurm:slurm /etc/slurm/slurmdbd.conf
    chmod 600 /etc/slurm/slurmdbd.conf
}

make_network() {  # the bridge, and a namespace a node with its end of a veth pair on it
    ip link add "$BRIDGE" type bridge
    ip addr add "$CONTROLLER_ADDRESS/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # Where the kernel passes bridged packets through iptables (br_netfilter, loaded by Docker
    # among others), a FORWARD policy of DROP would keep the nodes from reaching each other.
    if [ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]; then
        echo 0 >/proc/sys/net/bridge/bridge-nf-call-iptables
    fi
    local name address
    for entry in $EMULATED_NODES; do
        name=${entry%%:*} address=${entry#*:}
        ip netns add "vlft-$name"
        ip link add "vlft-$name" type veth peer name eth0 netns "vlft-$name"
        ip link set "vlft-$name" master "$BRIDGE" up
        ip -n "vlft-$name" addr add "$address/24" dev eth0
        ip -n "vlft-$name" link set eth0 up
        ip -n "vlft-$name" link set lo up
        # Its name resolves to its address on every node (gloo and torchrun use host names).
        grep -q "^$address $name\$" /etc/hosts || echo "$address $name" >>/etc/hosts
    done
}

remove_network() {
    local name address
    for entry in $EMULATED_NODES; do
        name=${entry%%:*} address=${entry#*:}
        ip netns del "vlft-$name" 2>/dev/null || true
        ip link del "vlft-$name" 2>/dev/null || true
        sed -i "/^$address $name\$/d" /etc/hosts 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

start_emulated_nodes() {  # each node's slurmd in its namespaces, its host name its node name
    # nsenter, not `ip netns exec`, which mounts a sysfs of its own over /sys and so hides the
    # cgroup file system slurmd reads.
    for entry in $EMULATED_NODES; do
        nsenter --net="/run/netns/vlft-${entry%%:*}" unshare --uts \
            sh -c "hostname ${entry%%:*} && exec slurmd -N ${entry%%:*}"
    done
}

start() {
    install
    stop >/dev/null 2>&1  # a cluster left from an earlier start: begin afresh
    # Without this, slurmctld recovers the jobs of an earlier start whose processes are gone, and
    # the node stays allocated to them; old job ids would also mix into sacct's answers.
    rm -rf "$STATE_DIR"/spool
    make_network
    write_config
    mkdir -p /run/munge /run/mysqld
    chown munge:munge /run/munge
    chown mysql:mysql /run/mysqld
    runuser -u munge -- /usr/sbin/munged
    wait_for 10 munge munge -n

    runuser -u mysql -- mariadbd --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
        --pid-file=/run/mysqld/mysqld.pid --skip-networking=0 --bind-address=127.0.0.1 \
        >"$STATE_DIR/log/mariadb.log" 2>&1 &
    wait_for 30 mariadb mariadb -e "select 1"
    mariadb -e "drop database if exists slurm_acct_db;
                create user if not exists 'slurm'@'localhost' identified by 'slurm';
                grant all on slurm_acct_db.* to 'slurm'@'localhost';"

    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n show cluster
    sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
    sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" >/dev/null 2>&1 || true
    sacctmgr -i add user root account="$ACCOUNT" cluster="$CLUSTER" >/dev/null 2>&1 || true

    slurmctld
    wait_for 30 slurmctld scontrol ping
    # -N: this node's name in slurm.conf, whatever the machine's hostname is.
    slurmd -N localhost
    start_emulated_nodes
    wait_for 60 "idle nodes" nodes_idle
    say "up: partitions $PARTITION (localhost) and $NODES_PARTITION (node1, node2), account $ACCOUNT, $(sinfo -h -p $PARTITION -o %c) CPUs and 2 GPUs a node"
}

nodes_idle() {  # true once every node takes jobs; a node that registered as down is asked back once more
    local idle=0 node state
    while read -r node state; do
        case "$state" in
        idle) idle=$((idle + 1)) ;;
        down* | drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 ;;
        esac
    done < <(sinfo -h -N -o "%N %t" 2>/dev/null)
    [ "$idle" -eq 3 ]
}

stop_daemon() {  # stop_daemon <pid file>
    local pidfile=$1 pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
}

stop() {
    for node in localhost node1 node2; do stop_daemon "$STATE_DIR/run/slurmd-$node.pid"; done
    stop_daemon "$STATE_DIR/run/slurmd.pid"  # an earlier version's
    stop_daemon "$STATE_DIR/run/slurmctld.pid"
    stop_daemon "$STATE_DIR/run/slurmdbd.pid"
    stop_daemon /run/mysqld/mysqld.pid
    if [ -f /run/munge/munged.pid ]; then stop_daemon /run/munge/munged.pid; fi
    # Stale pid files of the packages' own scripts break their removal.
    rm -f /run/slurmctld.pid /run/slurmd.pid /run/slurmdbd.pid
    remove_network
    say "stopped"
}

case "${1:-}" in
install) install ;;
start) start ;;
stop) stop ;;
*) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
