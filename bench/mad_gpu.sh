#!/usr/bin/env bash
# The MAD table on one GPU in one device call (docs/bench/mad.md): NVIDIA MPS (the runs' small kernels side by
# side), one short run per kind to build the kernels into the on-disk caches, then every kind x task x rate x seed
# in parallel processes. Rows stream to $OUT/mad.jsonl (what finished comes back even if the call is cut short).
# Usage: bash bench/mad_gpu.sh STEPS JOBS MAIN_TIMEOUT_S [extra CLI flags]
set -u
STEPS=${1:-600}; JOBS=${2:-16}; LIMIT=${3:-270}; shift 3 || true
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started" || echo "MPS not started"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1; pip show mamba_ssm 2>/dev/null | grep -i ^version
t0=$(date +%s)
for kind in attention pdssm mamba2 deltanet; do   # warm-up: compile each kind's kernels at the runs' shapes
  python3 -m llm_surgery.bench.mad --kinds $kind --steps 3 --seeds 1 --lr 1e-3,3e-3 --eval-examples 256 \
    > $OUT/warmup_$kind.log 2>&1 &
done
wait
echo "warm-up $(( $(date +%s) - t0 )) s"; tail -n 3 $OUT/warmup_*.log | cut -c1-300
t1=$(date +%s)
timeout $LIMIT python3 -m llm_surgery.bench.mad --tasks compress,memorize,in_context_recall,noisy_in_context_recall,fuzzy_in_context_recall,selective_copy \
  --kinds all --seeds 3 --lr 1e-3,3e-3 --steps $STEPS --jobs $JOBS --out $OUT/mad.jsonl "$@" > $OUT/main.log 2> $OUT/main.err
echo "main rc $? in $(( $(date +%s) - t1 )) s; rows: $(wc -l < $OUT/mad.jsonl)"
grep -v "^\(compress\|memorize\|in_context\|noisy\|fuzzy\|selective\)" $OUT/main.log | tail -n 12
tail -n 5 $OUT/main.err | cut -c1-400
python3 -m llm_surgery.bench.mad --summarize $OUT/mad.jsonl
echo quit | nvidia-cuda-mps-control
