#!/usr/bin/env bash
# A real, throwaway Slurm on this machine for the Slurm tests (tests/slurm_support.py) and for trying
# `chipledger slurm watch|actuate` by hand: Debian's slurm-wlm 22.05 with slurmdbd on MariaDB, 4 slurmd
# nodes of 8 fake GPUs each, two partitions of two GPU types, everything on loopback / unix sockets.
#
#   bash scripts/slurm.sh ensure   install the Debian packages when missing (only as root with apt-get;
#                                  otherwise say loudly what to install), and create the test's Unix users
#                                  (TEST_USERS: system accounts, no home, no login shell) when missing. Always
#                                  exits 0: whether a missing Slurm is a skip or a failure is the tests' decision
#                                  (CHIPLEDGER_REQUIRE_SLURM=1).
#   bash scripts/slurm.sh start    write the configs into $CHIPLEDGER_SLURM_DIR and start munged, mariadbd,
#                                  slurmdbd, slurmctld and slurmd x4; then create the accounts, QOS and
#                                  associations (see `setup` below). Prints `export SLURM_CONF=...`.
#   bash scripts/slurm.sh stop     stop every daemon it started, by the pids in the state dir
#   bash scripts/slurm.sh status   which daemons run (exit 1 if one is missing)
#
# Environment: CHIPLEDGER_SLURM_DIR (state dir, default /tmp/chipledger-slurm-$UID; `start` wipes it),
# CHIPLEDGER_SLURM_PORT (first of 7 TCP ports on 127.0.0.1, default 16817: slurmctld, slurmdbd, 4 slurmd).
#
# Why these settings (the tests must be quick on 2 cores): no cgroups (proctrack/linuxproc, task/none), no
# job accounting gather (the ledger reads allocations, not usage), MinJobAge=2 and a 1 s scheduler loop so
# short sleep jobs come and go in seconds, cred_expire=5 so a requeued job may start again after ~6 s instead
# of 120 s, preempt/qos with PreemptMode=REQUEUE. Slurm 22.05 ignores a GPU GRES without File=, so every fake
# GPU is a /dev/null clone (`mknod c 1 3`). AccountingStorageEnforce has no `limits`: GrpTRES gres/gpu is a
# quota the ledger accounts and reclaims (docs/slurm.md), not a hard cap in Slurm.
set -uo pipefail

DIR=${CHIPLEDGER_SLURM_DIR:-/tmp/chipledger-slurm-$(id -u)}
PORT=${CHIPLEDGER_SLURM_PORT:-16817}
CLUSTER=${CHIPLEDGER_SLURM_CLUSTER:-chipledger}
PACKAGES=(slurm-wlm slurmdbd slurm-client munge mariadb-server)
NODES=(n1 n2 n3 n4)
GPUS_PER_NODE=8
# Unix users whose jobs the tests submit as root with `sbatch --uid` (per-user books against sreport): jobs run as
# them, so they must exist on this host; their associations are in the account vision (setup_accounts)
TEST_USERS=(alice bob)

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # loud

installed() {
    local b
    for b in slurmctld slurmd slurmdbd munged mariadbd mariadb-install-db sacct sreport sacctmgr scontrol; do
        command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || return 1
    done
}

ensure_users() {  # as root: create the missing TEST_USERS (system accounts, no home, no login shell)
    local u
    [[ $(id -u) -eq 0 ]] || return 0
    for u in "${TEST_USERS[@]}"; do
        id -u "$u" >/dev/null 2>&1 && continue
        useradd --system --no-create-home --shell /usr/sbin/nologin "$u" \
            || loud "slurm.sh: could not create the test user $u (useradd failed): its jobs cannot run"
    done
}

ensure() {
    ensure_users
    installed && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "slurm.sh: installing Slurm from Debian packages (${PACKAGES[*]})..." >&2
        local t0=$SECONDS
        # policy-rc.d 101: the packages' postinst must not start system daemons (ours run from the state dir)
        local policy=/usr/sbin/policy-rc.d made_policy=
        if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && made_policy=1; fi
        if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${PACKAGES[@]}" >/dev/null; then
            echo "slurm.sh: Slurm installed in $((SECONDS - t0))s" >&2
        else
            loud "SLURM COULD NOT BE INSTALLED: apt-get install ${PACKAGES[*]} failed (see above)." \
                 "The Slurm tests will be skipped (or fail with CHIPLEDGER_REQUIRE_SLURM=1)."
        fi
        [[ -n $made_policy ]] && rm -f $policy
        return 0
    fi
    loud "SLURM NOT INSTALLED: the Slurm tests will be skipped (or fail with CHIPLEDGER_REQUIRE_SLURM=1)." \
         "Install, as root:  apt-get install --no-install-recommends ${PACKAGES[*]}" \
         "No daemon needs to be running: the tests start their own (bash scripts/slurm.sh start)."
    return 0
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # $1 seconds, $2.. a command that must succeed (each try bounded to 5 s)
    local deadline=$(( SECONDS + $1 )); shift
    while (( SECONDS < deadline )); do timeout 5 "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    return 1
}

write_configs() {
    local etc=$DIR/etc
    mkdir -p "$etc" "$DIR/log" "$DIR/run" "$DIR/ctld" "$DIR/dev" "$DIR/munge" "$DIR/mysql"
    chmod 700 "$DIR/munge"
    local p_ctld=$PORT p_dbd=$((PORT + 1)) i=0 node
    {
        cat <<EOF
# written by scripts/slurm.sh: a throwaway test cluster on loopback
ClusterName=$CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$p_ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5,socket=$DIR/munge/munge.socket
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,defer_batch
PriorityType=priority/multifactor
PreemptType=preempt/qos
PreemptMode=REQUEUE
JobRequeue=1
MinJobAge=2
KillWait=1
OverTimeLimit=0
InactiveLimit=0
MessageTimeout=5
SlurmctldTimeout=30
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$p_dbd
# the munge socket for talking to slurmdbd (AuthInfo's is used only inside the cluster)
AccountingStoragePass=$DIR/munge/munge.socket
AccountingStorageTRES=gres/gpu,gres/gpu:a100,gres/gpu:h100
AccountingStorageEnforce=associations,qos
AcctGatherNodeFreq=0
JobCompType=jobcomp/none
EOF
        for node in "${NODES[@]}"; do
            local type=a100
            (( i >= 2 )) && type=h100
            echo "NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 2 + i)) CPUs=16 RealMemory=64000 Gres=gpu:$type:$GPUS_PER_NODE State=UNKNOWN"
            i=$((i + 1))
        done
        echo "PartitionName=a100 Nodes=n1,n2 Default=YES MaxTime=30:00 State=UP"
        echo "PartitionName=h100 Nodes=n3,n4 MaxTime=30:00 State=UP"
    } >"$etc/slurm.conf"
    : >"$etc/gres.conf"
    i=0
    for node in "${NODES[@]}"; do
        local type=a100 g
        (( i >= 2 )) && type=h100
        for ((g = 0; g < GPUS_PER_NODE; g++)); do
            [[ -e $DIR/dev/$node-gpu$g ]] || mknod "$DIR/dev/$node-gpu$g" c 1 3
        done
        echo "NodeName=$node Name=gpu Type=$type File=$DIR/dev/$node-gpu[0-$((GPUS_PER_NODE - 1))]" >>"$etc/gres.conf"
        i=$((i + 1))
    done
    cat >"$etc/cgroup.conf" <<EOF
CgroupAutomount=no
EOF
    cat >"$etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$p_dbd
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$etc/slurmdbd.conf"
    cat >"$etc/my.cnf" <<EOF
[client-server]
socket=$DIR/run/mysqld.sock
[mysqld]
datadir=$DIR/mysql
pid-file=$DIR/run/mysqld.pid
log-error=$DIR/log/mysqld.log
skip-networking
innodb_buffer_pool_size=32M
innodb_log_file_size=16M
innodb_flush_log_at_trx_commit=0
innodb_lock_wait_timeout=900
performance_schema=OFF
EOF
}

start() {
    installed || { loud "Slurm is not installed: run \`bash scripts/slurm.sh ensure\` as root first."; return 1; }
    ensure_users
    stop quiet
    rm -rf "$DIR"
    mkdir -p "$DIR"
    write_configs
    local etc=$DIR/etc t0=$SECONDS
    export SLURM_CONF=$etc/slurm.conf MYSQL_UNIX_PORT=$DIR/run/mysqld.sock
    # munge: a key of our own, its socket in the state dir
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none && chmod 600 "$DIR/munge/munge.key"
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed" \
        || { echo "slurm.sh: munged did not start ($DIR/log/munged.log)" >&2; return 1; }
    # MariaDB on its unix socket only
    mariadb-install-db --defaults-file="$etc/my.cnf" --user=root --auth-root-authentication-method=socket \
        --skip-test-db >"$DIR/log/mysql-install.log" 2>&1 \
        || { echo "slurm.sh: mariadb-install-db failed ($DIR/log/mysql-install.log)" >&2; return 1; }
    (mariadbd --defaults-file="$etc/my.cnf" --user=root >>"$DIR/log/mysqld.log" 2>&1 &)
    wait_for 30 mariadb-admin --defaults-file="$etc/my.cnf" -uroot ping \
        || { echo "slurm.sh: MariaDB did not answer ($DIR/log/mysqld.log)" >&2; return 1; }
    slurmdbd || { echo "slurm.sh: slurmdbd did not start" >&2; return 1; }
    wait_for 30 sacctmgr -n list cluster \
        || { echo "slurm.sh: slurmdbd did not answer ($DIR/log/slurmdbd.log)" >&2; return 1; }
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
    slurmctld -f "$etc/slurm.conf" || { echo "slurm.sh: slurmctld did not start" >&2; return 1; }
    wait_for 30 scontrol ping || { echo "slurm.sh: slurmctld did not answer ($DIR/log/slurmctld.log)" >&2; return 1; }
    local node
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/spool/$node"
        slurmd -f "$etc/slurm.conf" -N "$node" || { echo "slurm.sh: slurmd $node did not start" >&2; return 1; }
    done
    local deadline=$(( SECONDS + 60 ))
    until all_idle; do
        (( SECONDS < deadline )) || { echo "slurm.sh: nodes not idle after 60 s:" >&2; sinfo -N >&2; return 1; }
        sleep 0.2
    done
    setup_accounts  # after slurmctld registered: it creates the typed TRES (gres/gpu:a100) in the database
    echo "slurm.sh: Slurm up in $((SECONDS - t0))s ($DIR)" >&2
    echo "export SLURM_CONF=$etc/slurm.conf"
}

all_idle() {
    local states
    states=$(timeout 5 sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')
    [[ "$states" == "idle " ]]
}

# Accounts (lower-case: Slurm lower-cases them), their GPU quotas as GrpTRES, root in every account (it runs
# most test jobs, with --account), the TEST_USERS in vision (jobs submitted for them with `sbatch --uid`), and QOS
# `high` that preempts `normal` by requeue. vision and nlp are under the parent account research (the ledger's
# teams research/vision and research/nlp of the org research); speech is a top-level account.
setup_accounts() {
    sacctmgr -i add qos high Priority=1000 Preempt=normal PreemptMode=requeue >/dev/null
    sacctmgr -i add account research,speech Cluster="$CLUSTER" >/dev/null
    sacctmgr -i add account vision,nlp Cluster="$CLUSTER" Parent=research >/dev/null
    sacctmgr -i modify account vision set GrpTRES=gres/gpu:a100=8 >/dev/null
    sacctmgr -i modify account nlp set GrpTRES=gres/gpu:a100=4,gres/gpu:h100=8 >/dev/null
    sacctmgr -i add user root Account=vision,nlp,speech QOS=normal,high DefaultQOS=normal >/dev/null
    local users
    users=$(IFS=,; echo "${TEST_USERS[*]}")
    sacctmgr -i add user "$users" Account=vision QOS=normal DefaultQOS=normal >/dev/null
}

stop_group() {  # pid files of daemons stopped together: TERM all, wait up to 10 s, then KILL what is left
    local pids=() f pid
    for f in "$@"; do
        [[ -f $f ]] || continue
        pid=$(cat "$f" 2>/dev/null)
        [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && kill "$pid" 2>/dev/null && pids+=("$pid")
        rm -f "$f"
    done
    local n=100 alive
    while (( n-- > 0 )); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        (( alive )) || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null; done
    return 0
}

stop() {
    local quiet=${1:-}
    [[ -d $DIR/run ]] || return 0
    # the nodes, then the controller, the database daemon, MariaDB and munge (each by the pid it wrote)
    stop_group "$DIR"/run/slurmd-*.pid
    stop_group "$DIR/run/slurmctld.pid"
    stop_group "$DIR/run/slurmdbd.pid"
    stop_group "$DIR/run/mysqld.pid"
    stop_group "$DIR/run/munged.pid"
    [[ -z $quiet ]] && echo "slurm.sh: stopped ($DIR)" >&2
    return 0
}

status() {
    local ok=0 f
    for f in munged mysqld slurmdbd slurmctld "${NODES[@]/#/slurmd-}"; do
        if pid_alive "$DIR/run/$f.pid"; then echo "$f running (pid $(cat "$DIR/run/$f.pid"))"
        else echo "$f not running"; ok=1; fi
    done
    return $ok
}

case "${1:-}" in
    ensure) ensure; exit 0 ;;
    start) start; exit $? ;;
    stop) stop; exit 0 ;;
    status) status; exit $? ;;
    *) echo "usage: $0 ensure|start|stop|status" >&2; exit 2 ;;
esac
