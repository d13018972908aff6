# shellcheck shell=bash
# Shared by run.sh (kind, CPU) and gpu.sh (a cluster with NVIDIA GPUs). Sourced, not run.

# The repository root and this folder, found with shell built-ins only (so the tool check runs on a bare PATH).
E2E_DIR="${BASH_SOURCE[0]%/*}"
[[ "$E2E_DIR" != "${BASH_SOURCE[0]}" ]] || E2E_DIR=.
E2E_DIR="$(cd "$E2E_DIR" && pwd)"
REPO_ROOT="$(cd "$E2E_DIR/../../.." && pwd)"
CHART="$REPO_ROOT/charts/grpo-lora-operator"
OPERATOR_NAMESPACE="${OPERATOR_NAMESPACE:-grpo-lora-system}"
RELEASE="${RELEASE:-grpo-lora}"
POLL_SECONDS="${POLL_SECONDS:-15}"

log() { printf '==> %s\n' "$*"; }

# Exits 0 with "skipped: ..." when a needed command is missing: the e2e is optional where its tools are.
require_tools() {
  local missing=() tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    local IFS=/
    printf 'skipped: %s not found (this end-to-end test needs %s)\n' "${missing[*]}" "$*"
    exit 0
  fi
}

require_docker_daemon() {
  if ! docker info >/dev/null 2>&1; then
    echo "skipped: docker is installed but its daemon is not reachable (docker info failed)"
    exit 0
  fi
}

# install_chart [helm flags...]: install or upgrade the operator and wait until its pod is ready.
install_chart() {
  log "helm upgrade --install $RELEASE (namespace $OPERATOR_NAMESPACE)"
  helm upgrade --install "$RELEASE" "$CHART" --namespace "$OPERATOR_NAMESPACE" --create-namespace \
    --wait --timeout 5m "$@"
}

ensure_namespace() {
  kubectl create namespace "$1" --dry-run=client -o yaml | kubectl apply -f -
}

# wait_for_job NAMESPACE NAME MIN_SYNC_ROUNDS TIMEOUT_SECONDS: 0 once the job has Succeeded with at least
# MIN_SYNC_ROUNDS sync rounds; 1 when it Failed, Succeeded short of them, or the time ran out.
wait_for_job() {
  local namespace="$1" name="$2" min_rounds="$3" timeout="$4"
  local deadline=$((SECONDS + timeout)) phase round status
  log "waiting up to ${timeout}s for $namespace/$name: phase Succeeded and syncRound >= $min_rounds"
  while ((SECONDS < deadline)); do
    kubectl get glj --namespace "$namespace" || true
    status="$(kubectl get glj "$name" --namespace "$namespace" \
      -o jsonpath='{.status.phase}{" "}{.status.syncRound}' 2>/dev/null || true)"
    read -r phase round <<<"$status" || true
    phase="${phase:-Pending}"
    round="${round:-0}"
    case "$phase" in
      Succeeded)
        if ((round >= min_rounds)); then
          log "$namespace/$name Succeeded after $round sync rounds"
          return 0
        fi
        echo "FAIL: $namespace/$name Succeeded after only $round sync rounds (wanted >= $min_rounds)"
        return 1
        ;;
      Failed)
        echo "FAIL: $namespace/$name Failed"
        return 1
        ;;
    esac
    sleep "$POLL_SECONDS"
  done
  echo "FAIL: $namespace/$name did not succeed within ${timeout}s (phase $phase, syncRound $round)"
  return 1
}

# What to read when a run fails: the job, its pods and events, and the logs of the operator and the workers.
dump_diagnostics() {
  local namespace="$1" name="$2"
  log "diagnostics for $namespace/$name"
  kubectl describe glj "$name" --namespace "$namespace" || true
  kubectl get pods,services,networkpolicies --namespace "$namespace" -o wide || true
  kubectl get events --namespace "$namespace" --sort-by=.lastTimestamp || true
  kubectl logs --namespace "$OPERATOR_NAMESPACE" --tail=200 \
    --selector "app.kubernetes.io/name=grpo-lora-operator,app.kubernetes.io/instance=$RELEASE" || true
  kubectl logs --namespace "$namespace" --selector "grpolora.dev/job=$name" --all-containers --prefix \
    --tail=200 || true
}
