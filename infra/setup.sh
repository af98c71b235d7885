#!/usr/bin/env bash
# One-time (and idempotent) Prefect set-up for the GPU node, run from the node's checkout:
#   - the work pool `gpu-node` (type process, one flow run at a time: the node holds one target at a time);
#   - the work pool `eagle3-monitor` (type process, one at a time): the monitor never queues behind a GPU run;
#   - the deployments of prefect.yaml (eagle3/full, eagle3/retrain, eagle3/benchmark, eagle3/monitor), and with them
#     the automation that runs eagle3/retrain on the monitor's event `eagle3.acceptance.degraded` for this registry.
# Run it again after pulling a new checkout or changing prefect.yaml: everything is created or updated in place.
#
#   infra/setup.sh CONFIG [--set section.field=value ...]
#
# PREFECT_API_URL (environment or active Prefect profile) names the server, e.g. http://127.0.0.1:4200/api.
# EAGLE3_VENV is the project's virtualenv (default: .venv in the checkout).
# When CONFIG and the overrides are prefect.yaml's default, `prefect deploy --all` deploys everything as written;
# otherwise it deploys a copy of prefect.yaml whose deployments take CONFIG (and the overrides) as their parameters.
# Three processes in all (eagle3 config, flows/setup.py, prefect deploy): each `prefect` command is a fresh interpreter.
set -euo pipefail

usage() {
  cat >&2 <<'EOF'
usage: infra/setup.sh CONFIG [--set section.field=value ...]
  CONFIG    the pipeline config the deployments run by default, e.g. configs/kimi-k25-8xh200.yaml
  --set     a config override (repeatable), passed on to the deployments' `overrides` parameter
environment: PREFECT_API_URL (required, here or in the Prefect profile), EAGLE3_VENV (default: CHECKOUT/.venv)
EOF
  exit 2
}

die() { echo "infra/setup.sh: $*" >&2; exit 1; }

[[ $# -ge 1 && $1 != -* ]] || usage
CONFIG=$1; shift
OVERRIDES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --set) [[ $# -ge 2 ]] || usage; OVERRIDES+=("$2"); shift 2 ;;
    --set=*) OVERRIDES+=("${1#--set=}"); shift ;;
    -h|--help) usage ;;
    *) echo "infra/setup.sh: unexpected argument '$1'" >&2; usage ;;
  esac
done

CHECKOUT=$(cd "$(dirname "$0")/.." && pwd -P)
VENV=${EAGLE3_VENV:-$CHECKOUT/.venv}
PY=$VENV/bin/python
PREFECT=$VENV/bin/prefect
[[ -x $PREFECT ]] || die "no Prefect in $VENV (make install, or set EAGLE3_VENV to the project's virtualenv)"
cd "$CHECKOUT"
[[ -f $CONFIG ]] || die "config '$CONFIG' not found (relative paths are relative to the checkout, $CHECKOUT)"
export PREFECT_SERVER_ANALYTICS_ENABLED=${PREFECT_SERVER_ANALYTICS_ENABLED:-false}

# A config that does not validate fails here, with the field and the fix, rather than in the first flow run.
SETS=()
for item in ${OVERRIDES[@]+"${OVERRIDES[@]}"}; do SETS+=(--set "$item"); done
"$VENV/bin/eagle3" config "$CONFIG" ${SETS[@]+"${SETS[@]}"} > /dev/null

# The Prefect side in one process (flows/setup.py): the server must answer at PREFECT_API_URL; the work pools
# `gpu-node` and `eagle3-monitor` (type process, one flow run at a time: the node holds one target; the monitor's
# windows form a streak; an existing pool of another type is an error, not replaced); and the
# prefect file to deploy (prefect.yaml, or a temporary copy defaulting to CONFIG and the overrides, since
# `prefect deploy --all` takes no parameters). It prints the registry's event resource, that file and the names.
SETUP=$("$PY" -m flows.setup "$CONFIG" ${SETS[@]+"${SETS[@]}"})
{ read -r EAGLE3_REGISTRY_RESOURCE; read -r DEPLOY_FILE; read -r DEPLOYMENTS; } <<< "$SETUP"
[[ $DEPLOY_FILE == prefect.yaml ]] || trap 'rm -f "$DEPLOY_FILE"' EXIT
# The monitor emits on the registry's event resource; the retrain's trigger matches it (prefect.yaml's build step).
export EAGLE3_REGISTRY_RESOURCE
"$PREFECT" --no-prompt deploy --all --prefect-file "$DEPLOY_FILE"

cat <<EOF

Set up: work pools 'gpu-node' and 'eagle3-monitor', deployments: $DEPLOYMENTS (default config
$CONFIG), eagle3/retrain triggered by eagle3.acceptance.degraded on $EAGLE3_REGISTRY_RESOURCE.
Next, on this node: infra/worker.sh and EAGLE3_WORKER_POOL=eagle3-monitor infra/worker.sh (or systemctl start
eagle3-worker eagle3-monitor-worker), then
  $PREFECT deployment run eagle3/full
EOF
