#!/usr/bin/env bash
# GPU check: the FSDP2 tests on CUDA (NCCL for FSDP, gloo for checkpoints) and the quick
# benchmark, in under 5 minutes on one GPU machine. Nothing is downloaded there: the
# roll-ckpt wheels and omegaconf with its parser come from `make wheels` (dist/, antlr4 built
# into a wheel there, it has none on PyPI), the rest from the machine's python3.
#
#   make wheels && scripts/gpu_check.sh            # writes gpu-check/ (log and results)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! $PY -c "import roll_ckpt, roll_ckpt_fs, roll_ckpt_fsdp2" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/roll-ckpt-site dist/*.whl || exit 1
  export PYTHONPATH=/tmp/roll-ckpt-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
export ROLL_CKPT_TEST_DEVICE=cuda ROLL_CKPT_TEST_NPROC=$(( NGPU >= 2 ? 2 : 1 ))
status=0
timeout 200 $PY -m pytest -q -p no:cacheprovider tests/strategy_fsdp2 2>&1 | tee "$OUT/tests.log" || status=1
if [ -f bench/__main__.py ]; then
  timeout 150 $PY -m bench --quick --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit $status
