#!/usr/bin/env bash
# Set up a Cloud TPU VM for easylm. Idempotent: running it twice changes nothing more.
#   ./tpu_vm_setup.sh            (from the repository root, on every TPU VM host)
# On a pod, run it on all workers at once, e.g.
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command='cd easylm && ./tpu_vm_setup.sh'
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv --upgrade-deps "${EASYLM_VENV:-$HOME/easylm-venv}"
# shellcheck disable=SC1091
source "${EASYLM_VENV:-$HOME/easylm-venv}/bin/activate"
python -m pip install -q "jax[tpu]==0.10.2"
python -m pip install -q -e .
python - <<'PY'
import jax
print(f"easylm ready: jax {jax.__version__}, {jax.device_count()} devices "
      f"({jax.local_device_count()} local), backend {jax.default_backend()}")
PY
