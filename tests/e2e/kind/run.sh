#!/usr/bin/env bash
# End-to-end on kind: a cluster with a trainer and an inference node pool, the images built from this repository
# and loaded into it, the chart installed, and a small CPU job (job-cpu.yaml) that must reach status.syncRound >= 3
# and phase Succeeded. Prints `kubectl get glj` while it waits.
#
#   tests/e2e/kind/run.sh
#
# Needs docker (with a running daemon), kind, kubectl and helm; without them it prints "skipped: ..." and exits 0,
# or 1 when CI is set or E2E_REQUIRED=1. Each run deletes the previous run's job and claim and rolls the operator
# onto the image it just built; after Succeeded it checks the reward and the final adapter (and, while the job runs,
# the NetworkPolicy: REQUIRE_NETWORK_POLICY=1 fails where the CNI does not enforce it).
# Environment: CLUSTER_NAME (default grpolora-e2e; an existing cluster of that name is reused and kept),
# KEEP_CLUSTER=1 (keep a cluster this script created), TIMEOUT_SECONDS (default 1800), POLL_SECONDS (default 15).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="${BASH_SOURCE[0]%/*}"
[[ "$here" != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=lib.sh
source "$here/lib.sh"

require_tools docker kind kubectl helm
require_docker_daemon

CLUSTER_NAME="${CLUSTER_NAME:-grpolora-e2e}"
TIMEOUT_SECONDS="${TIMEOUT_SECONDS:-1800}"
JOB_NAMESPACE=grpolora-e2e
JOB_NAME=e2e-cpu
CLAIM=e2e-cpu-checkpoints
MIN_SYNC_ROUNDS=3
# Local tags, loaded into the nodes; job-cpu.yaml names the worker image with imagePullPolicy Never.
OPERATOR_REPOSITORY=grpolora.local/operator
WORKER_IMAGE=grpolora.local/worker-cpu:e2e
TAG=e2e
PROBE_IMAGE="$WORKER_IMAGE"
PROBE_PULL_POLICY=Never

created_cluster=0
finish() {
  local status=$?
  if ((status != 0)); then
    dump_diagnostics "$JOB_NAMESPACE" "$JOB_NAME"
  fi
  if ((created_cluster)) && [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then
    log "deleting kind cluster $CLUSTER_NAME (KEEP_CLUSTER=1 keeps it)"
    kind delete cluster --name "$CLUSTER_NAME" || true
  fi
  exit "$status"
}
trap finish EXIT

if kind get clusters 2>/dev/null | grep -x "$CLUSTER_NAME" >/dev/null; then
  log "reusing kind cluster $CLUSTER_NAME"
else
  log "creating kind cluster $CLUSTER_NAME (node pools: trainer, inference)"
  kind create cluster --name "$CLUSTER_NAME" --config "$E2E_DIR/kind-config.yaml" --wait 180s
  created_cluster=1
fi
kubectl config use-context "kind-$CLUSTER_NAME"

log "building images"
docker build --target operator --tag "$OPERATOR_REPOSITORY:$TAG" "$REPO_ROOT"
docker build --target worker-cpu --tag "$WORKER_IMAGE" "$REPO_ROOT"
log "loading images into the nodes"
kind load docker-image --name "$CLUSTER_NAME" "$OPERATOR_REPOSITORY:$TAG" "$WORKER_IMAGE"

install_chart --set "image.repository=$OPERATOR_REPOSITORY" --set "image.tag=$TAG" \
  --set image.pullPolicy=Never --set logLevel=debug

ensure_namespace "$JOB_NAMESPACE"
fresh_job "$JOB_NAMESPACE" "$JOB_NAME" "$CLAIM"
ensure_claim "$JOB_NAMESPACE" "$CLAIM"
log "applying $JOB_NAME"
kubectl apply --namespace "$JOB_NAMESPACE" -f "$E2E_DIR/job-cpu.yaml"

wait_for_job "$JOB_NAMESPACE" "$JOB_NAME" "$MIN_SYNC_ROUNDS" "$TIMEOUT_SECONDS"
verify_result "$JOB_NAMESPACE" "$JOB_NAME" "$CLAIM"
kubectl get glj --namespace "$JOB_NAMESPACE" -o wide
log "PASS"
