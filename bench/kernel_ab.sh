#!/bin/bash
# Same-machine A/B of pd_scan kernel variants in one device call (docs/bench/kernels.md). A variant NAME is the
# working tree with the files in bench/variants/NAME/ (untracked; any of pd_scan.cu pd_scan.cuh pd_scan_bind.cpp
# cuda.py) put over it; "cur" is the working tree as is. Every variant is built in parallel, then each section runs
# pd_scan_bench.py per variant: check (quick float64 check, 112 cases), fullcheck, time (the warp kernel's forward
# table; the first variant again at the end), perm (the same with permutation P), prof (clock64 anatomy).
# usage: VARS="v0 cur" bash bench/kernel_ab.sh check time perm prof     (outputs under $OUT)
OUTD=${OUT:-/tmp/out}
VARS=${VARS:-"v0 cur"}
for v in $VARS; do
  rm -rf /tmp/t_$v; mkdir -p /tmp/t_$v; cp -r llm_surgery kernels bench /tmp/t_$v/
  for f in pd_scan.cu pd_scan.cuh pd_scan_bind.cpp; do [ -f bench/variants/$v/$f ] && cp bench/variants/$v/$f /tmp/t_$v/kernels/; done
  [ -f bench/variants/$v/cuda.py ] && cp bench/variants/$v/cuda.py /tmp/t_$v/llm_surgery/ops/pd_scan/cuda.py
done
date -u; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
for v in $VARS; do (cd /tmp/t_$v && LLM_SURGERY_KERNEL_CACHE=/tmp/kc_$v PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench python -c "from llm_surgery.ops.pd_scan import cuda as K; print('$v', K.available(), K.load_error())") & done; wait
echo "build $(( $(date +%s) - t0 )) s"
run() { v=$1; shift; (cd /tmp/t_$v && LLM_SURGERY_KERNEL_CACHE=/tmp/kc_$v PYTHONPATH=/tmp/t_$v:/tmp/t_$v/bench python bench/pd_scan_bench.py "$@"); }
FIRST=${VARS%% *}
for a in "$@"; do
  case $a in
    check) for v in $VARS; do [ $v = v0 ] && continue; echo "=== check $v"; run $v --quick --skip copy,fwd,fwd-block,bwd,algo,sweep,prof,b192,base --check-algos "" --out $OUTD/check_$v 2>&1 | grep -E "correctness|NO \||\| 4096 \| (64|128) \| (c64|f32|bf16|split_bf16)"; done ;;
    fullcheck) for v in $VARS; do [ $v = v0 ] && continue; echo "=== fullcheck $v"; run $v --skip copy,fwd,fwd-block,bwd,algo,sweep,prof,b192,base --out $OUTD/fullcheck_$v 2>&1 | grep -v "| yes |"; done ;;
    time) for v in $VARS $FIRST; do echo "=== $v"; run $v --skip check,copy,fwd-block,bwd,algo,sweep,prof,b192,base --out $OUTD/time_$v 2>&1 | grep -E "^\| (c64|split_f32|f32|split_bf16|bf16) |D2D copy bandwidth"; done ;;
    perm) for v in $VARS; do echo "=== perm $v"; run $v --pmode perm --skip check,copy,fwd-block,bwd,algo,sweep,prof,b192,base --out $OUTD/perm_$v 2>&1 | grep -E "^\| (c64|split_f32|split_bf16|bf16) "; done ;;
    prof) for v in $VARS; do echo "=== prof $v"; run $v --skip check,copy,fwd,fwd-block,bwd,algo,sweep,b192,base --out $OUTD/prof_$v 2>&1 | grep -E "^\| warp"; done ;;
  esac
done
