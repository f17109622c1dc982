#!/bin/bash
# session 11 run c: the fold decided per warp (vote.sync.all) instead of per thread.
# 1. wgemm_mgpu_check: session 10's default and the fold (every E8M0 byte: warps on both sides);
# 2. gpu_check --decode-only (dispatch default = the fold);
# 3. decode_probe at M = 16 (scale bytes 120..129: most warps take the two-multiply side);
# 4. gemm.py decode rows, prepared w4a16 and a4w4, with profiler spans
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 170 python benchmarks/wgemm_mgpu_check.py --only "ks4 ch2 lanes bk512 st5 L,ks4 ch2 lanes fold L" --budget 60 --preflight-timeout 45 --out $OUT/wgc > $OUT/c_wgemm.txt 2>&1
grep "^preflight\|^  M=\|FAIL" $OUT/c_wgemm.txt | cut -c1-220 | head -12; grep -c "ok=True" $OUT/c_wgemm.txt
timeout 110 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/c_gpu_check_decode.txt 2>&1
tail -1 $OUT/c_gpu_check_decode.txt; grep FAIL $OUT/c_gpu_check_decode.txt | cut -c1-300 | head -3
timeout 80 python benchmarks/decode_probe.py --m 16 --ks 8192,16384 --out $OUT/probe > $OUT/c_probe.txt 2>&1
grep -v Warning $OUT/c_probe.txt | head -6
timeout 190 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared --profile --out $OUT/gd > $OUT/c_gemm_decode.txt 2>&1
grep "timeline\|^\[" $OUT/c_gemm_decode.txt | head -24
