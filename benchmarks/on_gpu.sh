#!/usr/bin/env bash
# Every GPU figure of docs/BENCHMARKS.md and `make test-gpu`, on a lent GPU machine (no network; the packages travel
# in .gpu-carry, built here by ../shared/gpu/build-carry.sh). Its logs, traces and refreshed docs/BENCHMARKS.md come
# back in $OUT (or ./gpu-out): gpu.tgz (everything), BENCHMARKS.md, summary.txt. Parts, in this order:
#   bench   benchmarks.train_step --gpu: step table, memory at 512, a CUDA trace of CLIP / PCME++ / ProLIP-Llip (TS s),
#           then the compile part for the methods of COMPILE (TC s)  (3 min 15 s on an H200, imports included)
#   ingest  benchmarks.ingest on cuda, ProLIP ViT-B/16, the device path (TI s)
#   test    make test-gpu (TT s); with `accum` too, benchmarks.accumulation --gpu runs beside it (its memory exact,
#           its times under the tests' load)                    (test ~6 min on an H200, 2026-11-26)
#   accum   benchmarks.accumulation --gpu: a 16k contrastive batch by 64 micro-batches of 256 (TA s; four
#           methods took ~280 s on an H200, so six need ~7 min)
#   ckpt    benchmarks.checkpoint_upload on the node's CPUs, local storage (TK s): the 2 workers' steps/s with
#           checkpoints behind training against none, where cores are left for the upload (on 2 cores they are not)
# e.g. `bash benchmarks/on_gpu.sh bench`, then `bash benchmarks/on_gpu.sh test accum`.
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-gpu-out}; work=/tmp/gpu-work; rm -rf "$work"; mkdir -p "$work" "$out"
[ -f .gpu-carry/enter.sh ] && source .gpu-carry/enter.sh
t0=$(date +%s)
say() { echo "[$1 at $(( $(date +%s) - t0 )) s]" | tee -a "$work/summary.txt"; }
has() { [[ " $ARGS " == *" $1 "* ]]; }
ARGS="$*"
finish() {  # whatever ran comes back, also after a part's timeout
  cp docs/BENCHMARKS.md "$out/BENCHMARKS.md"; cp "$work/summary.txt" "$out/summary.txt"
  tar -czf "$out/gpu.tgz" -C "$work" . ; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.txt" 2>&1
python3 -c "import torch, ray, deepspeed, mlflow, timm; print(torch.__version__, ray.__version__, deepspeed.__version__,
mlflow.__version__, timm.__version__)" >> "$work/gpu.txt" 2>&1
cat "$work/gpu.txt" | tee -a "$work/summary.txt"; say imports
quiet() { grep -v "^DEBUG\|^{\|INFO\|(TrainController\|(RayTrainWorker\|(DatasetManager\|Warning\|warn" "$@"; }
if has bench; then
  timeout "${TS:-200}" python3 -m benchmarks.train_step --gpu --parts time,memory,trace --memory-batches 512 \
    --trace-dir "$work" > "$work/train_step.log" 2>&1; say "train_step rc $?"
  timeout "${TC:-150}" python3 -m benchmarks.train_step --gpu --parts compile --repeats 6 \
    --compile-models "${COMPILE:-CLIP,SigLIP,ProLIP,PCME++,Llip,ProLIP-Llip}" > "$work/compile.log" 2>&1; say "compile rc $?"
  quiet "$work/train_step.log" "$work/compile.log" | grep "^|\|^compile\|rror" | tee -a "$work/summary.txt" | tail -40
fi
if has ingest; then
  timeout "${TI:-200}" python3 -m benchmarks.ingest --models b16 --paths device --device cuda --batch 256 --bf16 \
    --samples 6000 --rounds 2 > "$work/ingest.log" 2>&1; say "ingest rc $?"
  quiet "$work/ingest.log" | grep "^|\|rror" | tee -a "$work/summary.txt" | tail -20
fi
if has accum && has test; then
  (timeout "${TA:-420}" python3 -m benchmarks.accumulation --gpu > "$work/accumulation.log" 2>&1; say "accumulation rc $?") &
fi
if has test; then
  timeout "${TT:-420}" python3 -m pytest -q -m gpu --durations=0 -p no:cacheprovider -s tests/test_gpu.py \
    > "$work/test_gpu.log" 2>&1; say "test_gpu rc $?"
  grep -a "\[test_gpu\]\|passed\|failed\|FAILED\|Error\|s call\|s setup" "$work/test_gpu.log" | cut -c1-300 \
    | tee -a "$work/summary.txt" | tail -50
  wait
elif has accum; then
  timeout "${TA:-420}" python3 -m benchmarks.accumulation --gpu > "$work/accumulation.log" 2>&1; say "accumulation rc $?"
fi
has accum && grep "^|" "$work/accumulation.log" | tee -a "$work/summary.txt"
if has ckpt; then
  timeout "${TK:-400}" python3 -m benchmarks.checkpoint_upload --model prolip_vit_b16 --steps 24 --every 6 \
    --storages local > "$work/checkpoint_upload.log" 2>&1; say "checkpoint_upload rc $?"
  quiet "$work/checkpoint_upload.log" | grep "^{\|^|\|rror" | tee -a "$work/summary.txt" | tail -20
fi
