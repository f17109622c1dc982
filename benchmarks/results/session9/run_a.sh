#!/bin/bash
# session 9 run a: word-parallel (SWAR) encode kernel vs the per-element one; 8192^3 fp8-prepared with it
# (now the dispatch tile); decode kernel: K order rotated per CTA and other pipeline depths
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/a_encode.txt 2>&1
timeout 150 python benchmarks/fp8_encode.py --budget-s 120 --out $OUT/enc >> $OUT/a_encode.txt 2>&1
grep -c " ok" $OUT/a_encode.txt; grep "WRONG\|error" $OUT/a_encode.txt | head -5
XLA_FLAGS=$NT timeout 130 python benchmarks/gemm.py --decode-m none --layers 8192x8192x8192 --fprop-only --only fp8-prepared,xla-fp8 --profile --out /tmp/gb > $OUT/a_gemm_big.txt 2>&1
grep "^| fprop" $OUT/a_gemm_big.txt
timeout 200 python benchmarks/wgemm_mgpu_check.py --only "ks4 pairs bk512 st5 P,ks4 rot pairs bk512 st5 P,ks4 pairs bk256 st8 P,ks4 pairs bk512 st3 P" --budget 150 --preflight-timeout 60 --out $OUT/wg > $OUT/a_wgemm.txt 2>&1
grep "ratio\|ok=False\|error" $OUT/a_wgemm.txt | head -20
ls -R $OUT | head -30
