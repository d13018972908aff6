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

# skip REASON: print "skipped: REASON" and stop. Green (exit 0) where the e2e is optional; red (exit 1) when CI is
# set (any value but "" / "0" / "false") or E2E_REQUIRED=1, so that a CI job that meant to run it cannot pass
# without running it.
skip() {
  echo "skipped: $*"
  if [[ "${E2E_REQUIRED:-0}" == 1 || ! "${CI:-}" =~ ^(|0|false)$ ]]; then
    echo "FAIL: the end-to-end test was required (CI or E2E_REQUIRED=1) but skipped"
    exit 1
  fi
  exit 0
}

# Skips when a needed command is missing: the e2e is optional where its tools are.
require_tools() {
  local missing=() tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    local IFS=/
    skip "${missing[*]} not found (this end-to-end test needs $*)"
  fi
}

require_docker_daemon() {
  if ! docker info >/dev/null 2>&1; then
    skip "docker is installed but its daemon is not reachable (docker info failed)"
  fi
}

# install_chart [helm flags...]: install or upgrade the operator, then roll its pod, so that a re-run on a reused
# cluster tests the image just built and loaded under the same tag (helm sees no change and would keep the old pod).
install_chart() {
  log "helm upgrade --install $RELEASE (namespace $OPERATOR_NAMESPACE)"
  helm upgrade --install "$RELEASE" "$CHART" --namespace "$OPERATOR_NAMESPACE" --create-namespace \
    --wait --timeout 5m "$@"
  local selector="app.kubernetes.io/name=grpo-lora-operator,app.kubernetes.io/instance=$RELEASE" deployment
  deployment="$(kubectl get deployment --namespace "$OPERATOR_NAMESPACE" --selector "$selector" -o name)"
  log "rolling $deployment onto the current image"
  kubectl rollout restart --namespace "$OPERATOR_NAMESPACE" "$deployment"
  kubectl rollout status --namespace "$OPERATOR_NAMESPACE" "$deployment" --timeout 5m
}

ensure_namespace() {
  kubectl create namespace "$1" --dry-run=client -o yaml | kubectl apply -f -
}

# fresh_job NAMESPACE NAME CLAIM: delete a job and checkpoint claim left by an earlier run (waiting until they are
# gone), so that every run starts a new job with new pods and finds no earlier final adapter.
fresh_job() {
  log "deleting any earlier $1/$2 and its claim $3"
  kubectl delete glj "$2" --namespace "$1" --ignore-not-found --wait=true --timeout 5m
  kubectl delete pvc "$3" --namespace "$1" --ignore-not-found --wait=true --timeout 5m
}

# probe NAMESPACE POD HOST PORT [LABELS]: 0 if a throw-away pod (with LABELS, if given) can open HOST:PORT.
probe() {
  local namespace="$1" pod="$2" host="$3" port="$4" labels="${5:-}"
  local args=(--namespace "$namespace" --image "$PROBE_IMAGE" --image-pull-policy "${PROBE_PULL_POLICY:-IfNotPresent}"
    --restart=Never --rm -i --quiet)
  [[ -z "$labels" ]] || args+=(--labels "$labels")
  kubectl run "$pod" "${args[@]}" --command -- \
    python -c "import socket; socket.create_connection(('$host', $port), timeout=5).close()" >/dev/null 2>&1
}

# check_network_policy NAMESPACE NAME: while the job runs, a pod of the job reaches trainer rank 0's sync port and a
# pod outside the job is refused there. A CNI that ignores NetworkPolicies is a warning (REQUIRE_NETWORK_POLICY=1:
# a failure); a job pod that cannot connect either makes the check inconclusive (the port may have closed).
check_network_policy() {
  local namespace="$1" name="$2" port host
  port="$(kubectl get glj "$name" --namespace "$namespace" -o jsonpath='{.status.rendezvous.syncPort}')"
  host="$name-trainer-0.$name-trainer.$namespace.svc"
  if ! probe "$namespace" "$name-probe-member" "$host" "$port" "grpolora.dev/job=$name"; then
    log "NetworkPolicy check inconclusive: a pod of the job could not reach $host:$port either"
    return 0
  fi
  if probe "$namespace" "$name-probe-outsider" "$host" "$port"; then
    if [[ "${REQUIRE_NETWORK_POLICY:-0}" == 1 ]]; then
      echo "FAIL: a pod outside $namespace/$name reached $host:$port: the NetworkPolicy is not in force"
      return 1
    fi
    log "WARNING: a pod outside the job reached $host:$port: this cluster's CNI does not enforce NetworkPolicies"
    return 0
  fi
  log "NetworkPolicy in force: a pod outside the job is refused on $host:$port"
  NETWORK_POLICY_CHECKED=1
}

# wait_for_job NAMESPACE NAME MIN_SYNC_ROUNDS TIMEOUT_SECONDS: 0 once the job has Succeeded with at least
# MIN_SYNC_ROUNDS sync rounds; 1 when it Failed, Succeeded short of them, or the time ran out.
wait_for_job() {
  local namespace="$1" name="$2" min_rounds="$3" timeout="$4"
  local deadline=$((SECONDS + timeout)) phase round status probed=0
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
      Running)
        if ((!probed && round >= 1)); then
          probed=1
          check_network_policy "$namespace" "$name" || return 1
        fi
        ;;
    esac
    sleep "$POLL_SECONDS"
  done
  echo "FAIL: $namespace/$name did not succeed within ${timeout}s (phase $phase, syncRound $round)"
  return 1
}

# verify_result NAMESPACE NAME: what a Succeeded job must also show: a reward in its status, the final adapter on
# its checkpoint claim (read by a throw-away pod), and, with REQUIRE_NETWORK_POLICY=1, the NetworkPolicy checked.
verify_result() {
  local namespace="$1" name="$2" claim="$3" reward
  reward="$(kubectl get glj "$name" --namespace "$namespace" -o jsonpath='{.status.rewardMean}')"
  if [[ -z "$reward" ]]; then
    echo "FAIL: $namespace/$name Succeeded without a reward in its status"
    return 1
  fi
  log "$namespace/$name: rewardMean $reward"
  local overrides
  overrides="$(printf '{"spec":{"volumes":[{"name":"c","persistentVolumeClaim":{"claimName":"%s"}}],"containers":[{"name":"check","image":"%s","imagePullPolicy":"%s","command":["test","-s","/c/final-adapter/adapter_model.safetensors"],"volumeMounts":[{"name":"c","mountPath":"/c"}]}]}}' \
    "$claim" "$PROBE_IMAGE" "${PROBE_PULL_POLICY:-IfNotPresent}")"
  if ! kubectl run "$name-adapter-check" --namespace "$namespace" --image "$PROBE_IMAGE" --restart=Never --rm -i \
    --quiet --overrides "$overrides" >/dev/null 2>&1; then
    echo "FAIL: no final adapter (final-adapter/adapter_model.safetensors) on claim $claim"
    return 1
  fi
  log "$namespace/$name: final adapter present on claim $claim"
  if [[ "${REQUIRE_NETWORK_POLICY:-0}" == 1 && "${NETWORK_POLICY_CHECKED:-0}" != 1 ]]; then
    echo "FAIL: the NetworkPolicy was not checked (the job was never seen Running with a sync round)"
    return 1
  fi
}

# ensure_claim NAMESPACE NAME: a small ReadWriteOnce claim for the checkpoints (and the final adapter); the
# cluster's default StorageClass provides it (kind: local-path).
ensure_claim() {
  kubectl apply --namespace "$1" -f - <<CLAIM
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $2
spec:
  accessModes: [ReadWriteOnce]
  resources:
    requests:
      storage: 1Gi
CLAIM
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
