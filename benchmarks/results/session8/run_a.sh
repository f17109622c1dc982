#!/bin/bash
# session 8 run a: flags in the demo step at d 4096 (corpus vs random), decode timeline, encode variants, 8192^3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/a_flags_corpus.txt 2>&1
XLA_FLAGS=$NT timeout 110 python benchmarks/fp8_flags.py --d-model 4096 --data corpus --lr 3e-4 --steps 8 >> $OUT/a_flags_corpus.txt 2>&1
XLA_FLAGS=$NT timeout 100 python benchmarks/fp8_flags.py --d-model 4096 --data random --steps 8 > $OUT/a_flags_random.txt 2>&1
timeout 100 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared --profile --out /tmp/gd > $OUT/a_gemm_decode.txt 2>&1
timeout 150 python benchmarks/fp8_encode.py --budget-s 110 --out $OUT/enc > $OUT/a_encode.txt 2>&1
XLA_FLAGS=$NT timeout 110 python benchmarks/gemm.py --decode-m none --layers 8192x8192x8192 --fprop-only --only fp8-prepared,xla-fp8 --profile --out /tmp/gb > $OUT/a_gemm_big.txt 2>&1
ls -R $OUT | head -30
