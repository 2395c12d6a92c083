#!/usr/bin/env bash
# A real single-node SLURM 22.05 cluster on this Debian machine, for trying (and testing) cluster=slurm:
# munge, mariadb + slurmdbd (accounting: submitit follows jobs with sacct), slurmctld, slurmd. Run as root.
#
#   scripts/slurm_cluster.sh start    install the packages if missing, configure, start what is not running
#                                     (idempotent: a second start changes nothing; ~15 s cold, <1 s warm)
#   scripts/slurm_cluster.sh stop     stop the daemons by the PIDs in their pidfiles (PURGE=1: wipe job state)
#   scripts/slurm_cluster.sh status   exit 0 when the cluster accepts jobs
#
# Env: SLURM_CPUS=16 CPUs advertised by the node (may exceed the real cores: a 4-point sweep fits at once);
#      SLURM_ACCOUNTING=1 run slurmdbd + mariadb.
set -euo pipefail
PIDFILES="/run/slurmd.pid /run/slurmctld.pid /run/slurmdbd.pid /run/mysqld/mysqld.pid /run/munge/munged.pid"

start() {
  T0=$(date +%s%N)
  CPUS=${SLURM_CPUS:-16}
  ACCT=${SLURM_ACCOUNTING:-1}
  NODE=$(hostname -s)
  export DEBIAN_FRONTEND=noninteractive
  alive() { local pid; pid=$(cat "$1" 2>/dev/null) && kill -0 "$pid" 2>/dev/null; }
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
  CONF="ClusterName=local
  SlurmctldHost=${NODE}(127.0.0.1)
  SlurmUser=root
  AuthType=auth/munge
  CredType=cred/munge
  MpiDefault=none
  ProctrackType=proctrack/linuxproc
  TaskPlugin=task/none
  ReturnToService=2
  SlurmctldPidFile=/run/slurmctld.pid
  SlurmdPidFile=/run/slurmd.pid
  SlurmdSpoolDir=/var/spool/slurmd
  StateSaveLocation=/var/spool/slurmctld
  SlurmctldLogFile=/var/log/slurm/slurmctld.log
  SlurmdLogFile=/var/log/slurm/slurmd.log
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
  NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN
  PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$CONF" ]; then
    printf '%s\n' "$CONF" > /etc/slurm/slurm.conf
    for p in /run/slurmd.pid /run/slurmctld.pid; do      # config changed: restart running daemons
      if alive $p; then kill "$(cat $p)"; for _ in $(seq 50); do alive $p || break; sleep 0.1; done; fi
    done
  fi
  [ "$ACCT" = 1 ] && { sacctmgr -i add cluster local >/dev/null 2>&1 || true; }  # exists -> harmless error
  alive /run/slurmctld.pid || slurmctld          # daemonizes + writes pidfile (keeps saved state)
  alive /run/slurmd.pid    || slurmd

  # 5. wait until the node is schedulable
  for _ in $(seq 150); do
    case "$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)" in
      idle*|mix*|alloc*) break;;
      down*|drain*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true;;
    esac
    sleep 0.2
  done
  sinfo
  echo "slurm ready in $(( ($(date +%s%N) - T0) / 1000000 )) ms"
}

stop() {
  for p in $PIDFILES; do
    if [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null; then
      pid=$(cat "$p"); kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
      echo "stopped $p ($pid)"
    fi
  done
  if [ "${PURGE:-0}" = 1 ]; then rm -rf /var/spool/slurmctld/* /var/spool/slurmd/* /var/log/slurm/*; fi
}

status() {
  command -v sinfo >/dev/null && [ -n "$(sinfo -h -o %t 2>/dev/null | grep -E 'idle|mix|alloc')" ] \
    && command -v sacct >/dev/null && sacct -n -X -S now >/dev/null 2>&1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if status; then echo "slurm is up"; else echo "slurm is not running"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
