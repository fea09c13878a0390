#!/usr/bin/env bash
# Slurm TaskProlog: tells each task of a job where its shardcastd is. Runs as
# the job's user before every task; Slurm reads its standard output
# ("export NAME=value" sets a variable in the task, "print TEXT" prints TEXT
# to the task's output). Prints
#   export SHARDCAST_ADDRESS=unix:$SHARDCAST_JOB_RUNDIR/job-$SLURM_JOB_ID/shardcastd.sock
# when prolog.sh started the job's daemon, else the node service's socket
# ($SHARDCAST_NODE_SOCKET, default /run/shardcast/shardcastd.sock) when it
# exists, else nothing. A SHARDCAST_ADDRESS the job set itself is kept. When
# the job's daemon failed to start it prints where its log is. Never fails
# the task. Settings as in prolog.sh (SHARDCAST_SLURM_DEFAULTS,
# SHARDCAST_JOB_RUNDIR).
set -uo pipefail

file=${SHARDCAST_SLURM_DEFAULTS:-/etc/shardcast/slurm.env}
if [[ -f $file && -r $file ]]; then
  # shellcheck source=/dev/null
  . "$file" >/dev/null 2>&1 || true
fi

# The job's own choice (or shardcast-job.sh's) wins.
if [[ -n ${SHARDCAST_ADDRESS:-} ]]; then exit 0; fi

job=${SLURM_JOB_ID:-}
base=${SHARDCAST_JOB_RUNDIR:-/run/shardcast-jobs}
base=${base%/}
dir=$base/job-$job
if [[ $job =~ ^[0-9]+$ ]]; then
  if [[ -S $dir/shardcastd.sock ]]; then
    echo "export SHARDCAST_ADDRESS=unix:$dir/shardcastd.sock"
    exit 0
  fi
  if [[ -d $dir ]]; then
    echo "print shardcast: the job's shardcastd is not running on ${HOSTNAME:-this node}; its log: $dir/shardcastd.log"
  fi
fi
node=${SHARDCAST_NODE_SOCKET:-/run/shardcast/shardcastd.sock}
if [[ -S $node ]]; then
  echo "export SHARDCAST_ADDRESS=unix:$node"
fi
exit 0
