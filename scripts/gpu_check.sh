#!/usr/bin/env bash
# Issue 31's device checks, sized for a lent GPU machine's calls (10 minutes each at most).
#
#   bash scripts/gpu_check.sh cli   OUT    # every task's real CLI on the GPU (benchmarks/gpu_cli.py), ~6 min
#   bash scripts/gpu_check.sh speed OUT    # gpu_suite.py (7 min budget) + the steady compiled step
#   bash scripts/gpu_check.sh compile OUT  # bench_compile.py: compile cost through the CLI, 4 tasks
#   bash scripts/gpu_check.sh fit   OUT    # gpu_fit.py: paper recipes' fit throughput, data loading included
#
# On a machine with PyTorch but without the suite's other requirements, first run
# `bash scripts/device_wheels.sh .whl` where PyPI is reachable and carry .whl along: this script
# installs what it finds there into /tmp/site. Results go to OUT (default benchmarks/gpu_results).
set -uo pipefail
stage=${1:?cli, speed, compile or fit}
out=${2:-benchmarks/gpu_results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline NO_ALBUMENTATIONS_UPDATE=1
export SUITE_DATA_CACHE=${SUITE_DATA_CACHE:-/tmp/suite-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)" \
  | tee -a "$out/machine.txt"
case "$stage" in
  cli)
    python3 benchmarks/gpu_cli.py --output "$out" --work /tmp/gpu_cli 2>&1 | tee "$out/gpu_cli.log" ;;
  speed)
    python3 benchmarks/gpu_suite.py --budget-s 400 --output "$out" 2>&1 | tee "$out/gpu_suite.log"
    python3 benchmarks/bench_compile.py --steady --accelerator gpu --output "$out/results_compile.md" 2>&1 \
      | tee -a "$out/gpu_suite.log" ;;
  compile)
    python3 benchmarks/bench_compile.py --accelerator gpu --precision bf16-mixed --max-epochs 1 \
      --tasks classify detect segment translate --output "$out/results_compile.md" 2>&1 | tee "$out/compile.log" ;;
  fit)
    python3 benchmarks/gpu_fit.py --output "$out" 2>&1 | tee "$out/gpu_fit.log"
    python3 benchmarks/gpu_fit.py --tasks classify --output "$out/regional" --extra --model.compile regional 2>&1 \
      | tee -a "$out/gpu_fit.log" ;;
  *) echo "unknown stage $stage: cli, speed, compile or fit" >&2; exit 2 ;;
esac
