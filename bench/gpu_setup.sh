#!/usr/bin/env bash
# Prepare a GPU machine that has torch (CUDA) but no network: install the wheels carried in .wheels/
# (duckdb, pytest, setuptools, ...) and megascope itself as an editable install, then print the setup.
#
#   bash bench/gpu_setup.sh            # from the repository root
set -euo pipefail
PY=${PYTHON:-python3}
if compgen -G ".wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --find-links .wheels --no-deps .wheels/*.whl 2>&1 | grep -v -i warning || true
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning || true
"$PY" - <<'PY'
import torch, megascope, megascope.collectors  # noqa: F401
print(f"torch {torch.__version__} cuda {torch.version.cuda} nccl {torch.cuda.nccl.version() if torch.cuda.is_available() else None}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
try:
    import duckdb
    print("duckdb", duckdb.__version__)
except ImportError:
    print("duckdb missing: analyses will run elsewhere")
PY
