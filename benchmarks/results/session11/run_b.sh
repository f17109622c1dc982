#!/bin/bash
# session 11 run b: fold_scale now the default of the one-kernel "lanes" tiling (4 warpgroups).
# 1. which of fold / delay failed run a's ks2 smoke check (preflights only, --budget 0);
# 2. gpu_check --decode-only (dispatch, prepare_decode weights: every E8M0 byte, NaN blocks);
# 3. gemm.py decode rows (w4a16 and a4w4 prepared, a4w4 quantized per call) with profiler spans;
# 4. decode_probe at M = 16 (fixed part and per-1024-K slope with the fold)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 125 python benchmarks/wgemm_mgpu_check.py --only "ks2 ch2 lanes fold L,ks2 ch2 lanes delay L" --budget 0 --preflight-timeout 45 --out $OUT/wgb > $OUT/b_bisect.txt 2>&1
grep "^preflight\|FAIL\|ok=" $OUT/b_bisect.txt | cut -c1-220 | head -12
timeout 110 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/b_gpu_check_decode.txt 2>&1
tail -1 $OUT/b_gpu_check_decode.txt; grep FAIL $OUT/b_gpu_check_decode.txt | cut -c1-300 | head -3
timeout 220 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared,pallas-prepared-q --profile --out $OUT/gd > $OUT/b_gemm_decode.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/b_gemm_decode.txt | head -30
timeout 90 python benchmarks/decode_probe.py --m 16 --out $OUT/probe > $OUT/b_probe.txt 2>&1
grep -v Warning $OUT/b_probe.txt | head -14
