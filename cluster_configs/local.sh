#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, with the topology labels the planner reads.
#
#   cluster_configs/local.sh up [NODES] [RACKS]   head (0 CPUs) + NODES one-CPU worker nodes,
#                                                 named w0.., split into RACKS racks (r0..)
#   cluster_configs/local.sh topology             the topology as elastic/placement/topology.py reads it
#   elastic run examples/<job>.yaml --address 127.0.0.1:6379 --set parallel.tp=2
#   ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m jobs.train examples/<job>.yaml
#                                                 the head serves the Ray Jobs API (dashboard on 127.0.0.1)
#   cluster_configs/local.sh down                 `ray stop`: stops EVERY Ray process of this
#                                                 user on the machine, not only this cluster
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
# Environment: RAY_PORT (default 6379), RAY_DASHBOARD_PORT (the Jobs API, default 8265), RAY (the ray executable, default: ray on PATH),
# PYTHON (default: python), RAY_TEMP_DIR (optional head --temp-dir),
# OBJECT_STORE_BYTES per node (default 200 MB: many raylets share one machine's memory).
set -euo pipefail

PORT=${RAY_PORT:-6379}
DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
RAY=${RAY:-ray}
PYTHON=${PYTHON:-python}
STORE=${OBJECT_STORE_BYTES:-200000000}
ADDRESS="127.0.0.1:${PORT}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

up() {
  local nodes=${1:-4} racks=${2:-2} i
  local temp=()
  if [ -n "${RAY_TEMP_DIR:-}" ]; then temp=(--temp-dir="${RAY_TEMP_DIR}"); fi
  if [ "${RAY_AUTH_MODE}" = token ] && [ -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ] \
    && [ ! -s "${HOME}/.ray/auth_token" ]; then
    "${RAY}" get-auth-token --generate >/dev/null
  fi
  "${RAY}" start --head --node-ip-address=127.0.0.1 --port="${PORT}" --num-cpus=0 \
    --object-store-memory="${STORE}" --include-dashboard=true --dashboard-host=127.0.0.1 \
    --dashboard-port="${DASHBOARD_PORT}" --disable-usage-stats "${temp[@]}"
  for ((i = 0; i < nodes; i++)); do
    "${RAY}" start --address="${ADDRESS}" --node-ip-address=127.0.0.1 --num-cpus=1 \
      --object-store-memory="${STORE}" --labels="name=w${i},rack=r$((i * racks / nodes))" \
      --disable-usage-stats
  done
  echo "cluster up: RAY_AUTH_MODE=${RAY_AUTH_MODE} elastic run CONFIG --address ${ADDRESS}"
  echo "Ray Jobs: RAY_AUTH_MODE=${RAY_AUTH_MODE} ray job submit --address http://127.0.0.1:${DASHBOARD_PORT} --working-dir . -- python -m jobs.train CONFIG"
}

topology() {
  RAY_ADDRESS="${ADDRESS}" "${PYTHON}" - <<'EOF'
import ray, yaml
from elastic.placement.topology import read_ray_topology

ray.init(logging_level="ERROR")
print(yaml.safe_dump(read_ray_topology().to_dict(), sort_keys=False))
EOF
}

case "${1:-up}" in
  up) shift || true; up "$@" ;;
  topology) topology ;;
  down) "${RAY}" stop ;;
  *) echo "usage: $0 up [NODES] [RACKS] | topology | down" >&2; exit 2 ;;
esac
