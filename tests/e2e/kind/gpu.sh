#!/usr/bin/env bash
# The GPU variant, on the cluster of the current kubectl context (nvkind, or any cluster with NVIDIA GPU nodes and
# the NVIDIA device plugin or GPU operator; README.md beside this file sets one up): installs the chart and runs
# job-gpu.yaml (SmolLM2-135M, NCCL sync between the two pools), waiting for syncRound >= 3 and phase Succeeded.
#
#   OPERATOR_IMAGE=registry.example.com/grpo/operator:0.1.0 \
#   WORKER_IMAGE=registry.example.com/grpo/worker-gpu:0.1.0 tests/e2e/kind/gpu.sh
#
# Needs kubectl and helm, and nodes labelled grpolora.dev/pool=trainer and grpolora.dev/pool=inference with
# allocatable nvidia.com/gpu; without them it prints "skipped: ..." and exits 0. The images must be pullable by
# the nodes (pushed to a registry, or `kind load`ed on nvkind); the defaults are the project's published images.
# Environment: OPERATOR_IMAGE, WORKER_IMAGE, TIMEOUT_SECONDS (default 3600), POLL_SECONDS (default 15).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="${BASH_SOURCE[0]%/*}"
[[ "$here" != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=lib.sh
source "$here/lib.sh"

require_tools kubectl helm

OPERATOR_IMAGE="${OPERATOR_IMAGE:-ghcr.io/grpo-lora-operator/operator:0.1.0}"
DEFAULT_WORKER_IMAGE=ghcr.io/grpo-lora-operator/worker-gpu:0.1.0
WORKER_IMAGE="${WORKER_IMAGE:-$DEFAULT_WORKER_IMAGE}"
TIMEOUT_SECONDS="${TIMEOUT_SECONDS:-3600}"
JOB_NAMESPACE=grpolora-e2e-gpu
JOB_NAME=e2e-gpu
MIN_SYNC_ROUNDS=3

for pool in trainer inference; do
  gpus="$(kubectl get nodes --selector "grpolora.dev/pool=$pool" \
    -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{" "}{end}')"
  if [[ -z "${gpus// /}" ]]; then
    echo "skipped: no node labelled grpolora.dev/pool=$pool with allocatable nvidia.com/gpu in $(kubectl config current-context)"
    exit 0
  fi
done

trap 'status=$?; ((status == 0)) || dump_diagnostics "$JOB_NAMESPACE" "$JOB_NAME"; exit "$status"' EXIT

install_chart --set "image.repository=${OPERATOR_IMAGE%:*}" --set "image.tag=${OPERATOR_IMAGE##*:}"

ensure_namespace "$JOB_NAMESPACE"
log "applying $JOB_NAME with worker image $WORKER_IMAGE"
sed "s|$DEFAULT_WORKER_IMAGE|$WORKER_IMAGE|g" "$E2E_DIR/job-gpu.yaml" | kubectl apply --namespace "$JOB_NAMESPACE" -f -

wait_for_job "$JOB_NAMESPACE" "$JOB_NAME" "$MIN_SYNC_ROUNDS" "$TIMEOUT_SECONDS"
kubectl get glj --namespace "$JOB_NAMESPACE" -o wide
log "PASS"
