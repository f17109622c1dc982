#!/bin/bash
# session 10 run b: where the decode kernel's time goes (kernel time over K, whole and with the
# compute removed); fp8 checks of 6ed2aaa; 8192x28672x8192 fp8 re-measured (session 6: 0.55x)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 200 python benchmarks/decode_probe.py --out $OUT/probe > $OUT/b_probe.txt 2>&1
cat $OUT/b_probe.txt | grep -v Warning | head -30
timeout 130 python benchmarks/gpu_check.py --fp8-only --out /tmp/gc > $OUT/b_gpu_check_fp8.txt 2>&1
tail -1 $OUT/b_gpu_check_fp8.txt; grep FAIL $OUT/b_gpu_check_fp8.txt | cut -c1-300 | head -3
XLA_FLAGS=$NT timeout 200 python benchmarks/gemm.py --decode-m none --layers 8192x28672x8192 --fprop-only --only fp8-prepared,xla-fp8 --profile --out /tmp/gb > $OUT/b_gemm_28672.txt 2>&1
grep "^| fprop\|ms ok\|timeline" $OUT/b_gemm_28672.txt | head
