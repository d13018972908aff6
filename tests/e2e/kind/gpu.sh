#!/usr/bin/env bash
# The GPU variant, on the cluster of the current kubectl context: nvkind with nvkind-config.yaml.tmpl (which makes
# two GPU workers, one per pool), or any cluster with NVIDIA GPU nodes and the NVIDIA device plugin or GPU operator
# (README.md beside this file sets one up). It installs the chart (and rolls the operator onto the given image),
# deletes any earlier run's job and claim, runs job-gpu.yaml (SmolLM2-135M, NCCL sync between the two pools) and waits for phase
# Succeeded with syncRound >= 3; checks that a pod outside the job is refused on the sync port while it runs, and
# that the job recorded a reward and left its final adapter on its checkpoint claim.
#
#   OPERATOR_IMAGE=registry.example.com/grpo/operator:0.1.0 \
#   WORKER_IMAGE=registry.example.com/grpo/worker-gpu:0.1.0 tests/e2e/kind/gpu.sh
#
# Needs kubectl and helm, and nodes labelled grpolora.dev/pool=trainer and grpolora.dev/pool=inference with
# allocatable nvidia.com/gpu; without them it prints "skipped: ..." and exits 0, or 1 when CI is set or
# E2E_REQUIRED=1 (a skipped run is never green in CI). The images must be pullable by the nodes (pushed to a
# registry, or `kind load`ed on nvkind). Environment: OPERATOR_IMAGE, WORKER_IMAGE (no defaults: no published
# images are assumed), TIMEOUT_SECONDS (default 3600), POLL_SECONDS (default 15), REQUIRE_NETWORK_POLICY=1 (fail,
# not warn, where the CNI does not enforce the job's NetworkPolicy), CI / E2E_REQUIRED.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="${BASH_SOURCE[0]%/*}"
[[ "$here" != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=lib.sh
source "$here/lib.sh"

require_tools kubectl helm

# The image job-gpu.yaml names, replaced by WORKER_IMAGE.
JOB_FILE_WORKER_IMAGE=ghcr.io/grpo-lora-operator/worker-gpu:0.1.0
TIMEOUT_SECONDS="${TIMEOUT_SECONDS:-3600}"
JOB_NAMESPACE=grpolora-e2e-gpu
JOB_NAME=e2e-gpu
CLAIM=e2e-gpu-checkpoints
MIN_SYNC_ROUNDS=3

for pool in trainer inference; do
  gpus="$(kubectl get nodes --selector "grpolora.dev/pool=$pool" \
    -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{" "}{end}')"
  if [[ -z "${gpus// /}" ]]; then
    skip "no node labelled grpolora.dev/pool=$pool with allocatable nvidia.com/gpu in $(kubectl config current-context)" \
      "(nvkind: create the cluster with tests/e2e/kind/nvkind-config.yaml.tmpl, see tests/e2e/kind/README.md)"
  fi
done
if [[ -z "${OPERATOR_IMAGE:-}" || -z "${WORKER_IMAGE:-}" ]]; then
  echo "FAIL: set OPERATOR_IMAGE and WORKER_IMAGE to images the nodes can pull (README.md beside this script)"
  exit 1
fi
PROBE_IMAGE="$WORKER_IMAGE"

trap 'status=$?; ((status == 0)) || dump_diagnostics "$JOB_NAMESPACE" "$JOB_NAME"; exit "$status"' EXIT

install_chart --set "image.repository=${OPERATOR_IMAGE%:*}" --set "image.tag=${OPERATOR_IMAGE##*:}"

ensure_namespace "$JOB_NAMESPACE"
fresh_job "$JOB_NAMESPACE" "$JOB_NAME" "$CLAIM"
ensure_claim "$JOB_NAMESPACE" "$CLAIM"
log "applying $JOB_NAME with worker image $WORKER_IMAGE"
sed "s|$JOB_FILE_WORKER_IMAGE|$WORKER_IMAGE|g" "$E2E_DIR/job-gpu.yaml" | kubectl apply --namespace "$JOB_NAMESPACE" -f -

wait_for_job "$JOB_NAMESPACE" "$JOB_NAME" "$MIN_SYNC_ROUNDS" "$TIMEOUT_SECONDS"
verify_result "$JOB_NAMESPACE" "$JOB_NAME" "$CLAIM"
kubectl get glj --namespace "$JOB_NAMESPACE" -o wide
log "PASS"
