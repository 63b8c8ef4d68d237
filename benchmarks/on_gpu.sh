#!/usr/bin/env bash
# Every GPU figure of docs/BENCHMARKS.md and `make test-gpu`, in one call of a lent GPU machine (no network; the
# packages travel in .gpu-carry, built here by ../shared/gpu/build-carry.sh). Logs and the refreshed
# docs/BENCHMARKS.md go to $OUT (or ./gpu-out). Parts: bench (benchmarks.train_step --gpu, benchmarks.ingest on
# cuda; ~5 min on an H100) and test (make test-gpu; ~8 min on an H100), e.g. `bash benchmarks/on_gpu.sh bench test`.
# TS / TI / TT: each part's time limit in seconds.
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-gpu-out}; mkdir -p "$out"
[ -f .gpu-carry/enter.sh ] && source .gpu-carry/enter.sh
t0=$(date +%s)
el() { echo "[$1 at $(( $(date +%s) - t0 )) s]"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, ray, deepspeed, mlflow, timm; print(torch.__version__, ray.__version__, deepspeed.__version__,
mlflow.__version__, timm.__version__)" >> "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"; el imports
if [[ " $* " == *" bench "* ]]; then
  timeout "${TS:-300}" python3 -m benchmarks.train_step --gpu > "$out/train_step.log" 2>&1; el "train_step rc $?"
  timeout "${TI:-240}" python3 -m benchmarks.ingest --models null,b16 --paths reader,device --device cuda --batch 256 \
    --bf16 --samples 6000 --rounds 2 > "$out/ingest.log" 2>&1; el "ingest rc $?"
  cp docs/BENCHMARKS.md "$out/BENCHMARKS.md"
  grep -v "^DEBUG\|^{\|INFO\|(TrainController\|(RayTrainWorker\|(DatasetManager" "$out/train_step.log" "$out/ingest.log" | tail -60
fi
if [[ " $* " == *" test "* ]]; then
  timeout "${TT:-540}" python3 -m pytest -q -m gpu --durations=0 -p no:cacheprovider -s tests/test_gpu.py \
    > "$out/test_gpu.log" 2>&1; el "test_gpu rc $?"
  grep -a "\[test_gpu\]\|passed\|failed\|FAILED\|s call\|s setup" "$out/test_gpu.log" | cut -c1-300 | tail -60
fi
