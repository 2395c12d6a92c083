#!/usr/bin/env bash
# A real SLURM 22.05 cluster on this Debian machine, for trying (and testing) cluster=slurm: munge, mariadb +
# slurmdbd (accounting: submitit follows jobs with sacct), slurmctld, and one slurmd, or NODES=N of them, each in
# a network namespace of its own (its own IP on a bridge, its own hostname slnodeI: a real multi-node cluster whose
# nodes share this machine's filesystem, as nodes share NFS). Run as root.
#
#   scripts/slurm_cluster.sh start    install the packages if missing, configure, start what is not running
#                                     (idempotent: a second start changes nothing; ~15 s cold, <1 s warm)
#   scripts/slurm_cluster.sh stop     stop the daemons by the PIDs in their pidfiles (PURGE=1: wipe job state)
#   scripts/slurm_cluster.sh status   exit 0 when the cluster accepts jobs
#
# Env: SLURM_CPUS=16 CPUs advertised in all (may exceed the real cores: a 4-point sweep fits at once), split
#      evenly over the nodes; SLURM_ACCOUNTING=1 run slurmdbd + mariadb; NODES=1 slurmd daemons (nodes).
# With NODES>1: pitfalls the spike found (shared/spikes/infra/slurm_multinode.sh): `ip netns exec` remounts /sys
# (slurmd then fails on cgroups), so slurmd enters with `nsenter --net`; slurmctld must be named by this
# machine's hostname, at the bridge's address; Debian's slurm-wlm-emulator is a front-end build (no use here).
set -euo pipefail
PIDFILES="/run/slurmd.pid /run/slurmctld.pid /run/slurmdbd.pid /run/mysqld/mysqld.pid /run/munge/munged.pid"
BRIDGE=brslurm; NET=10.231.0   # NODES>1: the nodes' network, slnodeI at $NET.I, this machine at $NET.254
alive() { local pid; pid=$(cat "$1" 2>/dev/null) && kill -0 "$pid" 2>/dev/null; }

network_up() {  # a bridge, and per node a namespace with a veth on it and a hosts line (idempotent)
  ip link show $BRIDGE >/dev/null 2>&1 || { ip link add $BRIDGE type bridge; ip addr add $NET.254/24 dev $BRIDGE
                                            ip link set $BRIDGE up; }
  for i in $(seq "$1"); do
    ns=slnode$i
    ip netns list | grep -q "^$ns\b" || {
      ip netns add $ns; ip link add vh$i type veth peer name vn$i; ip link set vn$i netns $ns
      ip link set vh$i master $BRIDGE; ip link set vh$i up
      ip netns exec $ns ip addr add $NET.$i/24 dev vn$i; ip netns exec $ns ip link set vn$i up
      ip netns exec $ns ip link set lo up; }
    grep -q " $ns\$" /etc/hosts || echo "$NET.$i $ns" >> /etc/hosts
  done
}

network_down() {
  for ns in $(ip netns list 2>/dev/null | grep -o '^slnode[0-9]*'); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true   # what a test left in a node
    ip netns del "$ns"; ip link del "vh${ns#slnode}" 2>/dev/null || true
  done
  ip link del $BRIDGE 2>/dev/null || true
  sed -i '/ slnode[0-9]*$/d' /etc/hosts
}

schedulable() { sinfo -h -t idle,mix,alloc -o %D 2>/dev/null | awk '{n += $1} END {print n + 0}'; }
slurmd_pidfiles() { ls /run/slurmd.pid /run/slurmd-slnode*.pid 2>/dev/null || true; }

start() {
  T0=$(date +%s%N)
  CPUS=${SLURM_CPUS:-16}
  ACCT=${SLURM_ACCOUNTING:-1}
  N=${NODES:-1}
  NODE=$(hostname -s)
  export DEBIAN_FRONTEND=noninteractive
  waitfor() { for _ in $(seq 150); do eval "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done; echo "timeout: $1" >&2; return 1; }

  # 1. packages (--no-install-recommends: 8 debs instead of 42; +22 for accounting)
  PKGS="slurmctld slurmd slurm-client munge"; [ "$ACCT" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
  MISSING=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  if [ -n "$MISSING" ]; then
    apt-get update -qq          # lists baked into an image may be stale -> 404s
    apt-get install -y -qq --no-install-recommends $MISSING >/dev/null
  fi
  install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm

  # 2. munge (package postinst generates /etc/munge/munge.key)
  install -d -o munge -g munge -m 0755 /run/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  alive /run/munge/munged.pid || runuser -u munge -- /usr/sbin/munged
  waitfor "munge -n | unmunge"

  # 3. accounting: mariadb (unix socket only) + slurmdbd
  if [ "$ACCT" = 1 ]; then
    install -d -o mysql -g root -m 0755 /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    alive /run/mysqld/mysqld.pid || { setsid mariadbd --user=mysql --skip-networking \
        --pid-file=/run/mysqld/mysqld.pid --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
        --log-error=/var/log/slurm/mariadb.log </dev/null >/dev/null 2>&1 & }
    waitfor "mariadb -e 'select 1'"
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
    DBD="AuthType=auth/munge
  DbdHost=localhost
  SlurmUser=root
  StorageType=accounting_storage/mysql
  StorageHost=localhost
  StorageUser=slurm
  StoragePass=slurm
  StorageLoc=slurm_acct_db
  PidFile=/run/slurmdbd.pid
  LogFile=/var/log/slurm/slurmdbd.log"
    if [ "$(cat /etc/slurm/slurmdbd.conf 2>/dev/null)" != "$DBD" ]; then
      printf '%s\n' "$DBD" > /etc/slurm/slurmdbd.conf; chmod 600 /etc/slurm/slurmdbd.conf
      if alive /run/slurmdbd.pid; then kill "$(cat /run/slurmdbd.pid)"; sleep 1; fi
    fi
    alive /run/slurmdbd.pid || slurmdbd
    waitfor "exec 3<>/dev/tcp/127.0.0.1/6819"                  # slurmdbd port
    ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
  AccountingStorageHost=localhost
  JobAcctGatherType=jobacct_gather/linux"
  else
    ACCT_LINES="AccountingStorageType=accounting_storage/none
  JobAcctGatherType=jobacct_gather/none"
  fi

  # 4. slurm.conf (no cgroups: proctrack/linuxproc + task/none work in containers)
  MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  if [ "$N" = 1 ]; then
    CTLD="${NODE}(127.0.0.1)"
    NODES_CONF="SlurmdPidFile=/run/slurmd.pid
  SlurmdSpoolDir=/var/spool/slurmd
  SlurmdLogFile=/var/log/slurm/slurmd.log
  NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN"
  else
    network_up "$N"
    CTLD="${NODE}(${NET}.254)"
    NODES_CONF="SlurmdPidFile=/run/slurmd-%n.pid
  SlurmdSpoolDir=/var/spool/slurmd/%n
  SlurmdLogFile=/var/log/slurm/slurmd-%n.log
  SlurmdTimeout=10
  NodeName=slnode[1-${N}] NodeAddr=${NET}.[1-${N}] CPUs=$((CPUS / N)) RealMemory=$((MEM / N)) State=UNKNOWN"
  fi
  CONF="ClusterName=local
  SlurmctldHost=${CTLD}
  SlurmUser=root
  AuthType=auth/munge
  CredType=cred/munge
  MpiDefault=none
  ProctrackType=proctrack/linuxproc
  TaskPlugin=task/none
  ReturnToService=2
  SlurmctldPidFile=/run/slurmctld.pid
  StateSaveLocation=/var/spool/slurmctld
  SlurmctldLogFile=/var/log/slurm/slurmctld.log
  SchedulerType=sched/backfill
  SchedulerParameters=sched_interval=2
  DependencyParameters=kill_invalid_depend
  SelectType=select/cons_tres
  SelectTypeParameters=CR_Core
  SlurmdParameters=config_overrides
  EnforcePartLimits=ALL
  ${ACCT_LINES}
  JobCompType=jobcomp/none
  MailProg=/bin/true
  KillWait=5
  MinJobAge=300
  InactiveLimit=0
  Waittime=0
  ${NODES_CONF}
  PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$CONF" ]; then
    printf '%s\n' "$CONF" > /etc/slurm/slurm.conf
    for p in $(slurmd_pidfiles) /run/slurmctld.pid; do   # config changed: restart running daemons
      if alive $p; then kill "$(cat $p)"; for _ in $(seq 50); do alive $p || break; sleep 0.1; done; fi
    done
    [ "$N" = 1 ] && network_down                          # back from several nodes to one
    rm -f /var/spool/slurmctld/node_state* /var/spool/slurmctld/part_state*   # other nodes: not the saved ones
  fi
  [ "$ACCT" = 1 ] && { sacctmgr -i add cluster local >/dev/null 2>&1 || true; }  # exists -> harmless error
  alive /run/slurmctld.pid || slurmctld          # daemonizes + writes pidfile (keeps saved state)
  if [ "$N" = 1 ]; then
    alive /run/slurmd.pid || slurmd
  else
    for i in $(seq "$N"); do
      mkdir -p /var/spool/slurmd/slnode$i
      alive /run/slurmd-slnode$i.pid || nsenter --net=/var/run/netns/slnode$i unshare --uts \
          sh -c "hostname slnode$i; exec slurmd"
    done
  fi

  # 5. wait until every node is schedulable
  for _ in $(seq 150); do
    [ "$(schedulable)" -ge "$N" ] && break
    for down in $(sinfo -h -t down,drain -o %N 2>/dev/null); do
      scontrol update nodename="$down" state=resume 2>/dev/null || true
    done
    sleep 0.2
  done
  sinfo
  echo "slurm ready in $(( ($(date +%s%N) - T0) / 1000000 )) ms"
}

stop() {
  for p in $(slurmd_pidfiles) $PIDFILES; do
    if [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null; then
      pid=$(cat "$p"); kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
      echo "stopped $p ($pid)"
    fi
  done
  network_down
  if [ "${PURGE:-0}" = 1 ]; then rm -rf /var/spool/slurmctld/* /var/spool/slurmd/* /var/log/slurm/*; fi
}

status() {  # up, with at least NODES schedulable nodes
  command -v sinfo >/dev/null && command -v sacct >/dev/null && sacct -n -X -S now >/dev/null 2>&1 \
    && [ "$(schedulable)" -ge "${NODES:-1}" ]
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if status; then echo "slurm is up"; else echo "slurm is not running"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
