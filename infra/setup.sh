#!/usr/bin/env bash
# One-time (and idempotent) Prefect set-up for the GPU node, run from the node's checkout:
#   - the work pool `gpu-node` (type process, one flow run at a time: the node holds one target at a time);
#   - the work pool `eagle3-monitor` (type process, one at a time): the monitor never queues behind a GPU run;
#   - the registry's global concurrency limit for CONFIG (flows.eagle3.ensure_registry_limit);
#   - the deployments of prefect.yaml (eagle3/full, eagle3/retrain, eagle3/benchmark, eagle3/monitor), and with them
#     the automation that runs eagle3/retrain on the monitor's event `eagle3.acceptance.degraded` for this registry.
# Run it again after pulling a new checkout or changing prefect.yaml: everything is created or updated in place.
#
#   infra/setup.sh CONFIG [--set section.field=value ...]
#
# PREFECT_API_URL (environment or active Prefect profile) names the server, e.g. http://127.0.0.1:4200/api.
# EAGLE3_VENV is the project's virtualenv (default: .venv in the checkout).
# When CONFIG and the overrides are prefect.yaml's default, `prefect deploy --all` deploys everything as written;
# otherwise each deployment is deployed with CONFIG (and the overrides) as its default parameters.
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
POOL=gpu-node
MONITOR_POOL=eagle3-monitor
[[ -x $PREFECT ]] || die "no Prefect in $VENV (make install, or set EAGLE3_VENV to the project's virtualenv)"
cd "$CHECKOUT"
[[ -f $CONFIG ]] || die "config '$CONFIG' not found (relative paths are relative to the checkout, $CHECKOUT)"
export PREFECT_SERVER_ANALYTICS_ENABLED=${PREFECT_SERVER_ANALYTICS_ENABLED:-false}

# A config that does not validate fails here, with the field and the fix, rather than in the first flow run.
SETS=()
for item in ${OVERRIDES[@]+"${OVERRIDES[@]}"}; do SETS+=(--set "$item"); done
"$VENV/bin/eagle3" config "$CONFIG" ${SETS[@]+"${SETS[@]}"} > /dev/null

# Without a server every `prefect` command would quietly use a throwaway local database.
API_URL=$("$PY" -c 'from prefect.settings import get_current_settings as s; print(s().api.url or "")')
[[ -n $API_URL ]] || die "PREFECT_API_URL is not set: export PREFECT_API_URL=http://SERVER:4200/api (see infra/README.md)"
"$PY" - "$API_URL" <<'EOF' || die "no Prefect server answers at $API_URL (is \`prefect server start\` running?)"
import sys, httpx
try:
    sys.exit(0 if httpx.get(sys.argv[1].rstrip("/") + "/health", timeout=10).status_code == 200 else 1)
except httpx.HTTPError as err:
    sys.exit(f"{type(err).__name__}: {err}")
EOF
echo "Prefect server: $API_URL"

# The work pools: created once; an existing pool of another type is an error, not silently replaced. Each runs one
# flow run at a time: the GPU pool because the node holds one target; the monitor's because its windows form a streak.
for pool in "$POOL" "$MONITOR_POOL"; do
  if pool_json=$("$PREFECT" --no-prompt work-pool inspect "$pool" --output json 2>/dev/null); then
    pool_type=$("$PY" -c 'import json, sys; print(json.load(sys.stdin)["type"])' <<< "$pool_json")
    [[ $pool_type == process ]] || die "work pool '$pool' exists with type '$pool_type'; it must be 'process' (delete it first)"
    echo "Work pool '$pool' (process) exists."
  else
    "$PREFECT" --no-prompt work-pool create "$pool" --type process > /dev/null
    echo "Work pool '$pool' (process) created."
  fi
  "$PREFECT" --no-prompt work-pool set-concurrency-limit "$pool" 1 > /dev/null
  echo "Work pool '$pool': one flow run at a time."
done

# The registry's global concurrency limit (limit 1): promotions and rollbacks of one registry never overlap.
LIMIT=$("$PY" -c 'import sys; from flows.eagle3 import ensure_registry_limit; print(ensure_registry_limit(sys.argv[1], sys.argv[2:]))' \
  "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"} | tail -n 1)
echo "Registry concurrency limit: $LIMIT"
# The registry's event resource: the monitor emits on it, the retrain's trigger (prefect.yaml) matches it.
EAGLE3_REGISTRY_RESOURCE=$("$PY" -c 'import sys; from eagle3.config import load_config; from tasks.run import registry_resource; print(registry_resource(load_config(sys.argv[1], sys.argv[2:]).registry))' \
  "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"} | tail -n 1)
export EAGLE3_REGISTRY_RESOURCE
echo "Registry event resource: $EAGLE3_REGISTRY_RESOURCE"

# The deployments. `prefect deploy --all` ignores --param/--params, so another config means one deploy per name.
read -r DEFAULT_CONFIG DEPLOYMENTS < <("$PY" - <<'EOF'
import yaml
spec = yaml.safe_load(open("prefect.yaml"))
configs = {d["parameters"]["config"] for d in spec["deployments"]}
assert len(configs) == 1, f"prefect.yaml: the deployments disagree on the default config: {sorted(configs)}"
print(configs.pop(), " ".join(d["name"] for d in spec["deployments"]))
EOF
)
if [[ $CONFIG == "$DEFAULT_CONFIG" && ${#OVERRIDES[@]} -eq 0 ]]; then
  "$PREFECT" --no-prompt deploy --all
else
  PARAMS=$("$PY" -c 'import json, sys; print(json.dumps({"config": sys.argv[1], "overrides": sys.argv[2:]}))' \
    "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"})
  for name in $DEPLOYMENTS; do
    "$PREFECT" --no-prompt deploy --name "$name" --params "$PARAMS"
  done
fi

cat <<EOF

Set up: work pools '$POOL' and '$MONITOR_POOL', registry limit '$LIMIT', deployments: $DEPLOYMENTS (default config
$CONFIG), eagle3/retrain triggered by eagle3.acceptance.degraded on $EAGLE3_REGISTRY_RESOURCE.
Next, on this node: infra/worker.sh and EAGLE3_WORKER_POOL=$MONITOR_POOL infra/worker.sh (or systemctl start
eagle3-worker eagle3-monitor-worker), then
  $PREFECT deployment run eagle3/full
EOF
