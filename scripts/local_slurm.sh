#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for testing multi-process runs.
#
#   scripts/local_slurm.sh up       # install slurm-wlm + munge if missing, configure, start
#   scripts/local_slurm.sh status   # which daemons run, and sinfo
#   scripts/local_slurm.sh down     # stop the daemons
#
# `up` (root only) installs Debian's slurm-wlm and munge with apt-get when they are
# missing, writes /etc/slurm/slurm.conf for one node (this host, its CPUs from `nproc`,
# its memory), creates the munge key if there is none, runs munged, slurmctld and
# slurmd directly (no systemd), waits until `sinfo` shows the node idle and prints one
# status line. Running it again is harmless: a running daemon is left alone unless the
# configuration it was started with changed. Errors are one line on stderr, exit 1.
# State lives under /var/spool/slurm-local, logs under /var/log/slurm-local.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
STATE=/var/spool/slurm-local
LOGS=/var/log/slurm-local
RUN=/run/slurm-local
MUNGE_KEY=/etc/munge/munge.key
MUNGE_SOCKET=/run/munge/munge.socket.2
PARTITION=local
WAIT_S=${LOCAL_SLURM_WAIT_S:-60}

die() {
  echo "error: local_slurm: $*" >&2
  exit 1
}

need_root() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons); try sudo $0 $1"
}

pid_alive() { # pid_alive FILE: the pid in FILE is a live process
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
    || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  command -v apt-get >/dev/null || die "${missing[*]} missing and apt-get is not available"
  echo "installing ${missing[*]} (apt-get)..."
  export DEBIAN_FRONTEND=noninteractive
  local log=/tmp/local_slurm_apt.log
  if ! { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
    >"$log" 2>&1; then
    die "apt-get install ${missing[*]} failed: $(tail -n 1 "$log") (full log: $log)"
  fi
}

memory_mb() { # 90% of MemTotal: slurmd drains a node that reports less than RealMemory
  awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo
}

write_config() { # prints "changed" when slurm.conf was (re)written
  local host cpus mem new
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(memory_mb)
  new=$(
    cat <<EOF
# Written by scripts/local_slurm.sh: a single-node cluster on $host.
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  )
  mkdir -p "$CONF_DIR"
  if [[ -f $CONF ]] && [[ "$(cat "$CONF")" == "$new" ]]; then
    return 0
  fi
  printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  echo changed
}

start_munge() {
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  if [[ ! -s $MUNGE_KEY ]]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$MUNGE_KEY" >/dev/null 2>&1 \
        || dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    else
      dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
  fi
  local user=root
  id munge >/dev/null 2>&1 && user=munge
  chown "$user:$user" /etc/munge "$MUNGE_KEY" /run/munge /var/lib/munge /var/log/munge
  chmod 0700 /etc/munge
  chmod 0400 "$MUNGE_KEY"
  chmod 0755 /run/munge
  if pid_alive /run/munge/munged.pid && munge -n </dev/null >/dev/null 2>&1; then
    return 0
  fi
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  if [[ $user == munge ]]; then
    runuser -u munge -- munged || die "munged did not start (see /var/log/munge/munged.log)"
  else
    munged --force || die "munged did not start (see /var/log/munge/munged.log)"
  fi
  for _ in $(seq 50); do
    munge -n </dev/null >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged started but does not answer (see /var/log/munge/munged.log)"
}

stop_daemon() { # stop_daemon NAME PIDFILE
  local pid
  pid_alive "$2" || {
    rm -f "$2"
    return 0
  }
  pid=$(cat "$2")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  rm -f "$2"
}

start_slurm() { # start_slurm CHANGED: restart the slurm daemons when the config changed
  mkdir -p "$STATE/ctld" "$STATE/d" "$LOGS" "$RUN"
  if [[ $1 == changed ]]; then
    stop_daemon slurmd "$RUN/slurmd.pid"
    stop_daemon slurmctld "$RUN/slurmctld.pid"
  fi
  if ! pid_alive "$RUN/slurmctld.pid"; then
    slurmctld -f "$CONF" || die "slurmctld did not start: $(tail -n 1 "$LOGS/slurmctld.log" 2>/dev/null)"
  fi
  if ! pid_alive "$RUN/slurmd.pid"; then
    slurmd -f "$CONF" || die "slurmd did not start: $(tail -n 1 "$LOGS/slurmd.log" 2>/dev/null)"
  fi
}

node_state() {
  sinfo -h -N -o '%t' 2>/dev/null | head -n 1 | tr -d '*~#!%$@^-'
}

wait_idle() {
  local state host
  host=$(hostname -s)
  for _ in $(seq $((WAIT_S * 2))); do
    state=$(node_state)
    case $state in
      idle | mix | alloc) return 0 ;;
      drain | drng | down | fail | inval)
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
        ;;
    esac
    sleep 0.5
  done
  die "node $host is not idle after ${WAIT_S} s (state ${state:-unknown}; logs in $LOGS)"
}

summary() {
  local host
  host=$(hostname -s)
  echo "local slurm: up; node $host $(node_state), $(nproc) CPUs, partition $PARTITION" \
    "(config $CONF, logs $LOGS)"
}

up() {
  need_root up
  install_packages
  local changed
  changed=$(write_config)
  start_munge
  start_slurm "$changed"
  wait_idle
  summary
}

down() {
  need_root down
  stop_daemon slurmd "$RUN/slurmd.pid"
  stop_daemon slurmctld "$RUN/slurmctld.pid"
  stop_daemon munged /run/munge/munged.pid
  echo "local slurm: down"
}

status() {
  local name file any=0
  for name in munged slurmctld slurmd; do
    case $name in
      munged) file=/run/munge/munged.pid ;;
      *) file=$RUN/$name.pid ;;
    esac
    if pid_alive "$file"; then
      echo "$name: running (pid $(cat "$file"))"
      any=1
    else
      echo "$name: not running"
    fi
  done
  if [[ $any -eq 1 ]] && command -v sinfo >/dev/null; then
    sinfo 2>&1 || true
  fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  *) die "usage: $0 up|down|status" ;;
esac
