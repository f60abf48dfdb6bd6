#!/usr/bin/env bash
# An emulated Slurm cluster on this host, for the real-Slurm tests of rendered batch scripts and
# submitit: Debian 12's Slurm 22.05 (built with --enable-multiple-slurmd), N slurmd daemons named
# node1..nodeN on localhost, each with 8 fake GPUs (symlinks to /dev/null; AutoDetect=off), plus
# slurmctld and slurmdbd on mariadb (submitit needs sacct to see jobs end).
#
#   launch/local_slurm.sh start [NODES]   # default 8; idempotent (restarts our daemons)
#   launch/local_slurm.sh status
#   launch/local_slurm.sh stop            # stops only the daemons in our pid files
#
# Emulated hosts with their own addresses (HPCTOOLKIT_SLURM_HOSTS=1, or the `up` / `down` actions):
# each node is a host in its own network namespace (hpct-n<i>) with two interfaces, as a real
# cluster node has a management network and a separate data plane:
#   eth0  the management network, 198.18.0.<10+i>/24 (MGMT_NET): Slurm's. slurmctld listens on this
#         host's 198.18.0.1 (veth hpct-head) and reaches each slurmd at its NodeAddr here.
#   ib0   the data plane, 198.18.1.<10+i>/24 (DATA_NET): the job's own traffic (`cluster.network`
#         in tests/recipes/multihost*.yaml). This host has no address on it, nor needs one.
# Each network is a bridge (br0, br1) in a namespace of its own (hpct-sw), so a link fault on ib0
# cuts a host off the data plane while Slurm still reaches its slurmd over eth0. The nodes are named
# host1..hostN and their names are never put in /etc/hosts: nothing may find a node's address by
# its name. slurmd runs in its node's namespace (NodeAddr = its eth0 address), so job steps on node
# K use node K's network.
#   launch/local_slurm.sh up [NODES]      # hosts + daemons; idempotent
#   launch/local_slurm.sh down            # the daemons, then every namespace, veth and bridge it made
#
# Clients need the config:  export SLURM_CONF=${HPCTOOLKIT_SLURM_STATE:-/tmp/hpctoolkit-slurm}/etc/slurm.conf
#
# Knobs: HPCTOOLKIT_SLURM_STATE (state folder), HPCTOOLKIT_SLURM_CPUS [16] CPUs declared per node
# (may exceed the real cores), HPCTOOLKIT_SLURM_GPUS [8] fake GPUs per node, HPCTOOLKIT_SLURM_RESET=1
# wipes controller state and accounting (job ids restart at 1), HPCTOOLKIT_SLURM_PIN [1] pins node i
# (its slurmd and so its job steps) to host core (i-1) mod the usable cores; 0 leaves every node all cores.
# munged and mariadb are system services shared with the host: started when down, never stopped.
# Needs root (slurmd runs jobs as their users) and the packages of launch/system_deps.sh.
set -euo pipefail

ACTION=${1:-start}
NNODES=${2:-8}
STATE=${HPCTOOLKIT_SLURM_STATE:-/tmp/hpctoolkit-slurm}
CPUS=${HPCTOOLKIT_SLURM_CPUS:-16}
GPUS=${HPCTOOLKIT_SLURM_GPUS:-8}
RESET=${HPCTOOLKIT_SLURM_RESET:-0}
PIN=${HPCTOOLKIT_SLURM_PIN:-1}
MEM=16000
CLUSTER=hpctoolkit
CTLD_PORT=6817
DBD_PORT=6819
NODE_PORT_BASE=17000
HOSTS_MODE=${HPCTOOLKIT_SLURM_HOSTS:-0}
# The project's own test hosts, and nothing else: 198.18.0.0/15 is reserved for network
# benchmarking (RFC 2544); the hosts use these two /24s only, and nothing routes out of them.
MGMT_NET=198.18.0 # eth0: Slurm (slurmctld on this host at .1, each slurmd at .<10+i>)
DATA_NET=198.18.1 # ib0: the data plane (cluster.network), hosts only
HEAD_IP=$MGMT_NET.1
NS=hpct
ETC=$STATE/etc
export SLURM_CONF=$ETC/slurm.conf
T0=$(date +%s%N)

say() {
  local ms=$((($(date +%s%N) - T0) / 1000000))
  printf '[local_slurm %d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*"
}

die() { echo "local_slurm: $*" >&2; exit 1; }

# SIGTERM the daemons named in our pid files, then wait (SIGKILL after 15 s).
stop_daemons() {
  local f pid pids=()
  for f in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid" "$STATE/run/slurmdbd.pid"; do
    [[ -f $f ]] || continue
    pid=$(cat "$f" 2>/dev/null || true)
    if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null && pids+=("$pid")
    fi
    rm -f "$f"
  done
  local _ alive pid2
  for _ in $(seq 1 150); do
    alive=0
    for pid2 in "${pids[@]}"; do kill -0 "$pid2" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.1
  done
  for pid2 in "${pids[@]}"; do kill -9 "$pid2" 2>/dev/null || true; done
}

wait_for() {  # wait_for SECONDS COMMAND...: poll until COMMAND succeeds
  local tries=$(($1 * 10)) _
  shift
  for _ in $(seq 1 "$tries"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
munge_ok() { munge -n | unmunge; }
ctld_up() { scontrol ping | grep -q UP; }

node_ip() { echo "$MGMT_NET.$((10 + $1))"; }
data_ip() { echo "$DATA_NET.$((10 + $1))"; }

# host_link NS IFNAME PEER BRIDGE ADDRESS: a veth IFNAME in host namespace NS at ADDRESS/24, its
# peer PEER on BRIDGE in hpct-sw; idempotent.
host_link() {
  local ns=$1 ifname=$2 peer=$3 bridge=$4 address=$5
  if ! ip -n "$ns" link show "$ifname" >/dev/null 2>&1; then
    ip -n "$ns" link add "$ifname" type veth peer name "$peer" netns "$NS-sw"
    ip -n "$ns" addr add "$address/24" dev "$ifname"
  fi
  ip -n "$ns" link set "$ifname" up
  ip -n "$NS-sw" link set "$peer" master "$bridge" up
}

hosts_up() {  # hosts_up N: the namespaces, a bridge per network and a veth per host on each; idempotent
  local i ns br
  ip netns list | grep -qw "$NS-sw" || ip netns add "$NS-sw"
  ip -n "$NS-sw" link set lo up
  for br in br0 br1; do
    ip -n "$NS-sw" link show "$br" >/dev/null 2>&1 || ip -n "$NS-sw" link add "$br" type bridge
    ip -n "$NS-sw" link set "$br" up
  done
  if ! ip link show "$NS-head" >/dev/null 2>&1; then
    ip link add "$NS-head" type veth peer name head netns "$NS-sw"
    ip addr add "$HEAD_IP/24" dev "$NS-head"
  fi
  ip link set "$NS-head" up
  ip -n "$NS-sw" link set head master br0 up
  for ((i = 1; i <= $1; i++)); do
    ns=$NS-n$i
    ip netns list | grep -qw "$ns" || ip netns add "$ns"
    ip -n "$ns" link set lo up
    host_link "$ns" eth0 "p$i" br0 "$(node_ip "$i")"
    host_link "$ns" ib0 "d$i" br1 "$(data_ip "$i")"
  done
  # Nothing leaves the namespaces: a host has routes into the two test subnets only (no default
  # route), and the switch namespace none at all.
  local ours="^(${MGMT_NET//./\\.}|${DATA_NET//./\\.})\.0/24 "
  for ((i = 1; i <= $1; i++)); do
    if ip -n "$NS-n$i" route show | grep -Ev "$ours" | grep -q .; then
      die "host$i has a route outside $MGMT_NET.0/24 and $DATA_NET.0/24: $(ip -n "$NS-n$i" route show | tr '\n' ';')"
    fi
  done
  if ip -n "$NS-sw" route show | grep -q .; then
    die "$NS-sw has a route: $(ip -n "$NS-sw" route show | tr '\n' ';')"
  fi
  say "hosts up: host1..host$1 at $(node_ip 1)..$(node_ip "$1") (eth0, Slurm; controller at $HEAD_IP)" \
    "and $(data_ip 1)..$(data_ip "$1") (ib0, data plane)"
}

hosts_down() {  # every namespace, veth and bridge hosts_up made (the bridges and the hosts' veths
  # go with their namespaces), and nothing else
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$NS-(n[0-9]+|sw)$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns"
  done
  ip link del "$NS-head" 2>/dev/null || true
}

case $ACTION in
  up)
    HOSTS_MODE=1
    ACTION=start
    ;;
  down)
    stop_daemons
    hosts_down
    say "slurm daemons stopped, emulated hosts removed (munged and mariadb left running)"
    exit 0
    ;;
esac

case $ACTION in
  stop)
    stop_daemons
    say "slurm daemons stopped (munged and mariadb left running)"
    exit 0
    ;;
  status)
    [[ -f $SLURM_CONF ]] || die "no cluster configured under $STATE"
    sinfo -N -o '%N %T %c %G' || true
    squeue || true
    exit 0
    ;;
  start) ;;
  *) echo "usage: $0 start|stop|status|up|down [NODES]" >&2; exit 2 ;;
esac

[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, got $NNODES"
[[ $(id -u) == 0 ]] || die "run as root"
for bin in munged slurmctld slurmd slurmdbd mysql ip nsenter; do
  command -v "$bin" >/dev/null || die "$bin is missing; run launch/system_deps.sh"
done

if [[ $HOSTS_MODE == 1 ]]; then
  PREFIX=host
  CTLD_HOST="$(hostname)($HEAD_IP)"
  hosts_up "$NNODES"
else
  PREFIX=node
  CTLD_HOST=localhost
  # Node names must resolve on this host (the batch script and the roles use them).
  names=$(seq -f 'node%g' -s ' ' 1 "$NNODES")
  if ! grep -qx "127.0.0.1 $names # hpctoolkit-slurm" /etc/hosts; then
    sed -i '/# hpctoolkit-slurm$/d' /etc/hosts
    echo "127.0.0.1 $names # hpctoolkit-slurm" >>/etc/hosts
  fi
fi

# munge: the host's key and daemon, created/started only when missing.
if [[ ! -s /etc/munge/munge.key ]]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge
chmod 700 /etc/munge
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge_ok >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  wait_for 5 munge_ok || die "munged did not come up"
fi
say "munged up"

stop_daemons
# Our daemons are down: a listener on their ports is another cluster's (another state folder's).
# Refuse rather than send our jobs to its controller or wipe its accounting (one shared database).
for port in "$CTLD_PORT" "$DBD_PORT"; do
  if port_open "$port"; then
    die "port $port is taken by a Slurm daemon not under $STATE: another emulated cluster runs here; stop it first (launch/local_slurm.sh stop with its HPCTOOLKIT_SLURM_STATE)"
  fi
done
if [[ $RESET == 1 ]]; then rm -rf "$STATE/state" "$STATE/spool" "$STATE/jobcomp.log"; fi
mkdir -p "$ETC" "$STATE"/{state,spool,log,run,fakegpu}

# Fake GPUs: Slurm wants device files; a symlink to /dev/null passes (a regular file is rejected
# and then CUDA_VISIBLE_DEVICES is never set).
rm -f "$STATE"/fakegpu/nvidia*
for ((g = 0; g < GPUS; g++)); do ln -s /dev/null "$STATE/fakegpu/nvidia$g"; done

cat >"$SLURM_CONF" <<EOF
# generated by launch/local_slurm.sh
ClusterName=$CLUSTER
SlurmctldHost=$CTLD_HOST
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.log
GresTypes=gpu
EOF
for ((i = 1; i <= NNODES; i++)); do
  addr=127.0.0.1
  [[ $HOSTS_MODE == 1 ]] && addr=$(node_ip "$i")
  echo "NodeName=$PREFIX$i NodeHostname=localhost NodeAddr=$addr Port=$((NODE_PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM Gres=gpu:$GPUS" >>"$SLURM_CONF"
done
echo "PartitionName=debug Nodes=${PREFIX}[1-$NNODES] Default=YES MaxTime=INFINITE State=UP" >>"$SLURM_CONF"
printf 'AutoDetect=off\nNodeName=%s[1-%d] Name=gpu File=%s/fakegpu/nvidia[0-%d]\n' \
  "$PREFIX" "$NNODES" "$STATE" $((GPUS - 1)) >"$ETC/gres.conf"

# Accounting: mariadb (the host's service) and our slurmdbd.
if ! mysqladmin ping >/dev/null 2>&1; then
  # Its temporary files go to /var/tmp: on a machine whose /tmp is not world-writable (seen here
  # 2026-12-08, mode 700) mariadb, running as mysql, could not start, and sacct hung the waits.
  TMPDIR=/var/tmp /etc/init.d/mariadb start --tmpdir=/var/tmp >/dev/null
  wait_for 30 mysqladmin ping || die "mariadb did not come up"
fi
if [[ $RESET == 1 ]]; then mysql -uroot -e "DROP DATABASE IF EXISTS hpctoolkit_slurm_acct;"; fi
mysql -uroot -e "CREATE DATABASE IF NOT EXISTS hpctoolkit_slurm_acct;
  CREATE USER IF NOT EXISTS 'hpctoolkit_slurm'@'localhost' IDENTIFIED BY 'hpctoolkit';
  GRANT ALL ON hpctoolkit_slurm_acct.* TO 'hpctoolkit_slurm'@'localhost'; FLUSH PRIVILEGES;"
cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=hpctoolkit_slurm_acct
StorageUser=hpctoolkit_slurm
StoragePass=hpctoolkit
EOF
chmod 600 "$ETC/slurmdbd.conf"
slurmdbd
wait_for 20 port_open "$DBD_PORT" || die "slurmdbd did not listen on $DBD_PORT (see $STATE/log/slurmdbd.log)"
if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
  sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null
fi
say "slurmdbd up"

slurmctld
wait_for 20 ctld_up || die "slurmctld did not answer (see $STATE/log/slurmctld.log)"
say "slurmctld up"
# Each emulated node owns a slice of this host's cores, as a real node owns its own: node i's
# slurmd is pinned to host core (i-1) mod the cores this script may use, and its job steps inherit
# the mask (TaskPlugin=task/none leaves affinity alone), so two engine nodes never bind the same core.
mapfile -t CORES < <(taskset -pc $$ | sed 's/.*: //' | tr ',' '\n' |
  awk -F- '{ if (NF == 2) { for (c = $1; c <= $2; c++) print c } else print $1 }')
for ((i = 1; i <= NNODES; i++)); do
  run=()
  # `ip netns exec` would remount /sys without the cgroup filesystem, which slurmd needs.
  [[ $HOSTS_MODE == 1 ]] && run=(nsenter "--net=/run/netns/$NS-n$i")
  [[ $PIN == 1 ]] && run+=(taskset -c "${CORES[$(((i - 1) % ${#CORES[@]}))]}")
  "${run[@]}" slurmd -N "$PREFIX$i"
done

idle=0
states=""
for _ in $(seq 1 300); do
  states=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
  if [[ $states == "idle " ]]; then idle=1; break; fi
  # DRAIN/DOWN survive restarts in the state folder: resume them.
  bad=$(sinfo -h -N -t drain,drained,draining,down,fail -o '%N' 2>/dev/null | sort -u | paste -sd, -)
  if [[ -n $bad ]]; then scontrol update nodename="$bad" state=resume >/dev/null 2>&1 || true; fi
  sleep 0.2
done
((idle)) || die "nodes did not become idle: $states (see $STATE/log)"
say "cluster ready: $NNODES nodes x $CPUS CPUs x $GPUS fake GPUs; export SLURM_CONF=$SLURM_CONF"
