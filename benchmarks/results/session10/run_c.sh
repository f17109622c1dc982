#!/bin/bash
# session 10 run c: the decode kernel with each warpgroup's tile decoded in parts (WGMMAs of one
# part run while the next decodes), with 2 or 4 compute warpgroups, and with bfloat16 scales
# (no E8M0 conversion in the kernel); E8M0 conversion now one multiply + two selects (all variants);
# 8192x8192x28672 fp8 re-measured (session 6: 0.55x)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
XLA_FLAGS=$NT timeout 120 python benchmarks/gemm.py --decode-m none --layers 8192x8192x28672 --fprop-only --only fp8-prepared,xla-fp8 --profile --out /tmp/gb > $OUT/c_gemm_28672.txt 2>&1
grep "^| fprop\|ms ok\|timeline" $OUT/c_gemm_28672.txt | head
timeout 440 python benchmarks/wgemm_mgpu_check.py --only "ks2 pairs bk512 st5 P,ks4 pairs bk512 st5 P,ks4 ch2 pairs bk512 st5 P,ks2 ch2 pairs bk512 st5 P,ks2 ch4 pairs bk512 st5 P,ks4 pairs bk512 st5 P B,ks4 ch2 pairs bk512 st5 P B" --budget 350 --preflight-timeout 60 --out $OUT/wg > $OUT/c_wgemm.txt 2>&1
grep "^preflight\|^  M=\|FAIL" $OUT/c_wgemm.txt | cut -c1-250 | head -40
