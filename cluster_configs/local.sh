#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, with the topology labels the planner reads.
#
#   cluster_configs/local.sh up [NODES] [RACKS]   head (0 CPUs) + NODES one-CPU worker nodes,
#                                                 named w0.., split into RACKS racks (r0..)
#   cluster_configs/local.sh topology             the topology as elastic/placement/topology.py reads it
#   elastic run examples/<job>.yaml --address 127.0.0.1:PORT --set parallel.tp=2
#   ray job submit --address http://127.0.0.1:DASHBOARD_PORT --working-dir . -- python -m jobs.train examples/<job>.yaml
#                                                 PORT and DASHBOARD_PORT as `up` printed them
#   cluster_configs/local.sh down                 stops this cluster's processes only (those
#                                                 under the temp dir `up` made); other Ray
#                                                 clusters of this user on the host are left alone
#
# Shared hosts: `up` picks free ports (or takes RAY_PORT / RAY_DASHBOARD_PORT /
# RAY_CLIENT_PORT), gives the cluster a temp dir of its own, prints all of it, and records
# it in $STATE (default ${TMPDIR:-/tmp}/elastic-local-$USER.env); a second `up` while one is
# recorded is refused. `down` signals only the recorded processes and any process whose
# command line names the cluster's temp dir (the raylets, GCS, dashboard and workers), never
# `ray stop`.
#
# Each worker node gets `--labels name=wI,rack=rJ` (Ray node labels). Racks are contiguous:
# with 4 nodes and 2 racks, w0 and w1 are in r0, w2 and w3 in r1. With one CPU per node a
# tp=2 job puts each TP group on two nodes (allowed on device=cpu only), so
# `up 4 2` runs dp=2 x tp=2, one replica per rack.
#
# Authentication: Ray 2.60 turns token auth on for a head started with `ray start --head`
# when a token exists (~/.ray/auth_token), but a later `ray start --address` or `ray.init`
# only sends it when RAY_AUTH_MODE=token. This script uses token mode for every node and
# generates the token if there is none; export the same RAY_AUTH_MODE=token before
# `elastic run --address ...` (or set RAY_AUTH_MODE=disabled for all of them).
#
# Environment: RAY_PORT, RAY_DASHBOARD_PORT (the Jobs API), RAY_CLIENT_PORT (default: free
# ports), RAY (the ray executable, default: ray on PATH), PYTHON (default: python),
# RAY_TEMP_DIR (the cluster's temp dir, default: a new one under ${TMPDIR:-/tmp}), STATE,
# OBJECT_STORE_BYTES per node (default 200 MB: many raylets share one machine's memory).
set -euo pipefail

RAY=${RAY:-ray}
PYTHON=${PYTHON:-python}
STORE=${OBJECT_STORE_BYTES:-200000000}
STATE=${STATE:-${TMPDIR:-/tmp}/elastic-local-${USER:-$(id -u)}.env}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

free_port() {
  "${PYTHON}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# the processes whose command line names $1 (the cluster's temp dir), one pid a line
cluster_pids() {
  ps -ww -eo pid=,args= | TARGET="$1" awk -v self="$$" 'ENVIRON["TARGET"] != "" && index($0, ENVIRON["TARGET"]) && $1 != self { print $1 }'
}

up() {
  local nodes=${1:-4} racks=${2:-2} i
  if [ -s "${STATE}" ]; then
    echo "error: a cluster is recorded in ${STATE} (cluster_configs/local.sh down first, or STATE=...)" >&2
    exit 2
  fi
  local port=${RAY_PORT:-$(free_port)} dashboard=${RAY_DASHBOARD_PORT:-$(free_port)} client=${RAY_CLIENT_PORT:-$(free_port)}
  local temp_dir=${RAY_TEMP_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/ray-local-XXXXXX")}
  local address="127.0.0.1:${port}"
  mkdir -p "${temp_dir}"
  printf 'PORT=%s\nDASHBOARD_PORT=%s\nCLIENT_PORT=%s\nTEMP_DIR=%s\n' "${port}" "${dashboard}" "${client}" "${temp_dir}" >"${STATE}"
  if [ "${RAY_AUTH_MODE}" = token ] && [ -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ] \
    && [ ! -s "${HOME}/.ray/auth_token" ]; then
    "${RAY}" get-auth-token --generate >/dev/null
  fi
  # Ray writes the token with the umask (0644): a password, readable by its owner only.
  [ -f "${HOME}/.ray/auth_token" ] && [ ! -L "${HOME}/.ray/auth_token" ] && chmod 600 "${HOME}/.ray/auth_token"
  "${RAY}" start --head --node-ip-address=127.0.0.1 --port="${port}" --num-cpus=0 \
    --object-store-memory="${STORE}" --include-dashboard=true --dashboard-host=127.0.0.1 \
    --dashboard-port="${dashboard}" --ray-client-server-port="${client}" --disable-usage-stats \
    --temp-dir="${temp_dir}"
  for ((i = 0; i < nodes; i++)); do
    "${RAY}" start --address="${address}" --node-ip-address=127.0.0.1 --num-cpus=1 \
      --object-store-memory="${STORE}" --labels="name=w${i},rack=r$((i * racks / nodes))" \
      --disable-usage-stats --temp-dir="${temp_dir}"
  done
  echo "PIDS='$(cluster_pids "${temp_dir}" | tr '\n' ' ')'" >>"${STATE}"
  echo "cluster up: ports ${port} (GCS), ${dashboard} (dashboard, Jobs API), ${client} (client); temp dir ${temp_dir}; recorded in ${STATE}"
  echo "export ELASTIC_RAY_ADDRESS=${address} ELASTIC_JOBS_ADDRESS=http://127.0.0.1:${dashboard}"
  echo "elastic run: RAY_AUTH_MODE=${RAY_AUTH_MODE} elastic run CONFIG --address ${address}"
  echo "Ray Jobs: RAY_AUTH_MODE=${RAY_AUTH_MODE} ray job submit --address http://127.0.0.1:${dashboard} --working-dir . -- python -m jobs.train CONFIG"
}

down() {
  if [ ! -s "${STATE}" ]; then
    echo "error: no cluster recorded in ${STATE}: nothing of ours to stop (other Ray clusters are left alone)" >&2
    exit 2
  fi
  local TEMP_DIR="" PIDS="" pid pids i st
  # shellcheck disable=SC1090
  . "${STATE}"
  [ -n "${TEMP_DIR}" ] || { echo "error: ${STATE}: no TEMP_DIR" >&2; exit 2; }
  # the cluster's processes now: the recorded PIDS that still name its temp dir (a reused pid
  # does not) and the ones started since (workers); nothing else
  pids=$(cluster_pids "${TEMP_DIR}")
  if [ -n "${pids}" ]; then
    # shellcheck disable=SC2086
    kill -TERM ${pids} 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do  # up to 10 s for them to end, then SIGKILL the rest
      pids=$(for pid in ${pids}; do  # still running (a zombie has ended)
        st=$(ps -o stat= -p "${pid}" 2>/dev/null || true)
        if [ -n "${st}" ] && [ "${st#Z}" = "${st}" ]; then echo "${pid}"; fi
      done)
      [ -z "${pids}" ] && break
      sleep 0.1
    done
    # shellcheck disable=SC2086
    [ -n "${pids}" ] && kill -KILL ${pids} 2>/dev/null || true
  fi
  rm -f "${STATE}"
  echo "cluster down: its processes under ${TEMP_DIR} stopped; other Ray clusters untouched"
}

topology() {
  local PORT=""
  # shellcheck disable=SC1090
  [ -s "${STATE}" ] && . "${STATE}"
  [ -n "${PORT}" ] || { echo "error: no cluster recorded in ${STATE}" >&2; exit 2; }
  RAY_ADDRESS="127.0.0.1:${PORT}" "${PYTHON}" - <<'EOF'
import ray, yaml
from elastic.placement.topology import read_ray_topology

ray.init(logging_level="ERROR")
print(yaml.safe_dump(read_ray_topology().to_dict(), sort_keys=False))
EOF
}

case "${1:-up}" in
  up) shift || true; up "$@" ;;
  topology) topology ;;
  down) down ;;
  *) echo "usage: $0 up [NODES] [RACKS] | topology | down" >&2; exit 2 ;;
esac
