#!/usr/bin/env bash
# A Prefect worker of the GPU node: polls a work pool (EAGLE3_WORKER_POOL: `gpu-node`, the default, or
# `eagle3-monitor`, the production monitor's, so that it never waits behind a GPU run) and runs each flow run as a
# subprocess of the project's virtualenv, in this checkout (the deployments' pull step changes into it). One flow run
# at a time.
#
#   infra/worker.sh [extra `prefect worker start` options, e.g. --run-once]
#
# PREFECT_API_URL (environment or active Prefect profile) names the server, e.g. http://127.0.0.1:4200/api.
# EAGLE3_VENV is the project's virtualenv (default: .venv in the checkout); EAGLE3_WORKER_NAME the worker's name
# (default: eagle3-HOSTNAME, eagle3-monitor-HOSTNAME for the monitor's pool). systemd runs this through
# infra/eagle3-worker.service and infra/eagle3-monitor-worker.service.
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  echo "usage: infra/worker.sh [prefect worker start options, e.g. --run-once]" >&2
  echo "environment: PREFECT_API_URL (required), EAGLE3_VENV (default: CHECKOUT/.venv), EAGLE3_WORKER_NAME," >&2
  echo "  EAGLE3_WORKER_POOL (gpu-node, the default, or eagle3-monitor)" >&2
  exit 2
fi

POOL=${EAGLE3_WORKER_POOL:-gpu-node}
case $POOL in
  gpu-node) NAME=eagle3 ;;
  eagle3-monitor) NAME=eagle3-monitor ;;
  *) echo "infra/worker.sh: EAGLE3_WORKER_POOL '$POOL' is not a pool of infra/setup.sh (gpu-node, eagle3-monitor)" >&2; exit 2 ;;
esac
CHECKOUT=$(cd "$(dirname "$0")/.." && pwd -P)
VENV=${EAGLE3_VENV:-$CHECKOUT/.venv}
[[ -x $VENV/bin/prefect ]] || { echo "infra/worker.sh: no Prefect in $VENV (make install, or set EAGLE3_VENV)" >&2; exit 1; }
cd "$CHECKOUT"

API_URL=$("$VENV/bin/python" -c 'from prefect.settings import get_current_settings as s; print(s().api.url or "")')
if [[ -z $API_URL ]]; then
  echo "infra/worker.sh: PREFECT_API_URL is not set: export PREFECT_API_URL=http://SERVER:4200/api (see infra/README.md)" >&2
  exit 1
fi

# Flow runs inherit this environment. The venv's bin comes first so `torchrun`, `eagle3` and `python` are the
# project's. Prefect must not re-resolve the project with `uv run` (it would install a different torch).
export PATH="$VENV/bin:$PATH"
export PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES=false
export PREFECT_SERVER_ANALYTICS_ENABLED=${PREFECT_SERVER_ANALYTICS_ENABLED:-false}
export PYTHONUNBUFFERED=1

echo "eagle3 worker: pool $POOL, server $API_URL, checkout $CHECKOUT, venv $VENV"
exec "$VENV/bin/prefect" --no-prompt worker start \
  --pool "$POOL" --type process \
  --name "${EAGLE3_WORKER_NAME:-$NAME-$(uname -n)}" \
  --limit 1 \
  --install-policy never \
  --no-create-pool-if-not-found \
  "$@"
