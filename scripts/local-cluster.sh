#!/usr/bin/env bash
# A real single-node scheduler on this machine, for the tests and for trying the cluster examples by hand.
#
#   scripts/local-cluster.sh slurm up [DIR]    # installs Debian's slurmctld, slurmd, slurm-client, slurmdbd and
#                                              # mariadb-server if missing, writes DIR/slurm.conf for this
#                                              # machine's cores and memory, starts the accounting database, the
#                                              # controller and the node daemon with their state, spool and logs
#                                              # under DIR, waits until the node is idle, and prints
#                                              # `export SLURM_CONF=...`
#   scripts/local-cluster.sh slurm down [DIR]  # stops them (DIR defaults to ${TMPDIR:-/tmp}/nightshift-slurm)
#
# One node, one partition (`debug`), every daemon on 127.0.0.1 ports chosen at start-up. Authentication is
# Slurm's `auth/none` (a single-node cluster reached only from this machine; a real cluster uses munge), process
# tracking `linuxproc` and no task plugin (no cgroups: containers often lack them). Accounting as on a production
# cluster: slurmdbd over a MariaDB server of its own (data directory DIR/mariadb, a user for slurmdbd alone with a
# password made at start-up, kept in the mode-600 DIR/slurmdbd.conf), so `sacct` answers with every run of every job
# and its exit code. Daemons run as the calling user, which must be root (slurmd starts jobs as their submitter).
set -euo pipefail

engine=${1:-}
action=${2:-}
dir=${3:-${TMPDIR:-/tmp}/nightshift-slurm}
[ "$engine" = slurm ] || { echo "usage: $0 slurm up|down [DIR]" >&2; exit 2; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

daemons="slurmctld slurmd slurmdbd mariadb"

down() {
    for daemon in $daemons; do
        if [ -f "$dir/$daemon.pid" ]; then
            kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
        fi
    done
    for daemon in $daemons; do
        for _ in $(seq 50); do
            [ -f "$dir/$daemon.pid" ] && kill -0 "$(cat "$dir/$daemon.pid")" 2>/dev/null || break
            sleep 0.1
        done
        rm -f "$dir/$daemon.pid"
    done
}

case "$action" in
up)
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
        ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
        sudo=$([ "$(id -u)" = 0 ] || echo sudo)
        $sudo apt-get update -qq
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client slurmdbd mariadb-server >/dev/null
    fi
    [ "$(id -u)" = 0 ] || { echo "$0: slurmd must run as root to start jobs as their submitter" >&2; exit 1; }
    down
    rm -rf "$dir/state" "$dir/spool" "$dir/mariadb"
    mkdir -p "$dir/state" "$dir/spool"
    # The accounting database: a MariaDB server of this cluster's own, on 127.0.0.1 only.
    db_port=$(free_port)
    mariadb-install-db --no-defaults --datadir="$dir/mariadb" --user=root --auth-root-authentication-method=normal \
        --skip-test-db >"$dir/mariadb-install.log" 2>&1 ||
        { cat "$dir/mariadb-install.log" >&2; echo "$0: mariadb-install-db failed" >&2; exit 1; }
    mariadbd --no-defaults --datadir="$dir/mariadb" --socket="$dir/mariadb.sock" --port="$db_port" \
        --bind-address=127.0.0.1 --user=root --pid-file="$dir/mariadb.pid" --log-error="$dir/mariadb.log" \
        --skip-log-bin --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 >/dev/null 2>&1 &
    sql() { mariadb --no-defaults --socket="$dir/mariadb.sock" -u root "$@"; }
    for _ in $(seq 100); do
        sql -e 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.2
    done
    sql -e 'SELECT 1' >/dev/null || { echo "$0: MariaDB did not start within 20 s; log: $dir/mariadb.log" >&2; exit 1; }
    password=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
    # On standard input, not the command line, where other processes could read the password.
    sql <<<"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$password'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    dbd_port=$(free_port)
    # slurmdbd reads slurmdbd.conf beside $SLURM_CONF; it holds the password, so only its owner may read it.
    (umask 077 && cat >"$dir/slurmdbd.conf" <<EOF
AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
LogFile=$dir/slurmdbd.log
PidFile=$dir/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$password
StorageLoc=slurm_acct_db
EOF
    )
    node=$(hostname -s)
    # The node as slurmd sees it (CPUs, sockets, cores, threads, memory), less 1 GiB of memory for the system.
    hardware=$(slurmd -C | head -1 | sed -e "s/^NodeName=[^ ]* //" -e 's/ RealMemory=\([0-9]*\)/ RealMemory=\1/')
    memory=$(echo "$hardware" | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    hardware=$(echo "$hardware" | sed "s/RealMemory=[0-9]*/RealMemory=$((memory > 2048 ? memory - 1024 : memory))/")
    cat >"$dir/slurm.conf" <<EOF
ClusterName=nightshift
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
SchedulerParameters=sched_interval=1
KillWait=30
NodeName=$node NodeAddr=127.0.0.1 $hardware State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    export SLURM_CONF="$dir/slurm.conf"
    slurmdbd
    for _ in $(seq 100); do
        sacctmgr -n list cluster >/dev/null 2>&1 && break
        sleep 0.2
    done
    sacctmgr -i add cluster nightshift >/dev/null ||
        { echo "$0: slurmdbd did not answer within 20 s; log: $dir/slurmdbd.log" >&2; exit 1; }
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N "$node"
    for _ in $(seq 100); do
        if sinfo -h -N -o '%t' 2>/dev/null | grep -q '^idle'; then
            echo "export SLURM_CONF=$SLURM_CONF"
            exit 0
        fi
        sleep 0.2
    done
    echo "$0: the Slurm node did not become idle within 20 s; logs: $dir/slurmctld.log, $dir/slurmd.log, $dir/slurmdbd.log" >&2
    sinfo -N >&2 || true
    exit 1
    ;;
down)
    down
    ;;
*)
    echo "usage: $0 slurm up|down [DIR]" >&2
    exit 2
    ;;
esac
