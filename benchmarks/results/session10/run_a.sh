#!/bin/bash
# session 10 run a: decode kernel with the tile-major weight layout and/or x multicast across a
# CTA cluster of 2 or 4 (each variant checked against backend "xla" before it is timed; preflight
# children catch a cluster-barrier hang); then the decode checks of 6ed2aaa's unpadded-x change
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/a_wgemm.txt 2>&1
timeout 420 python benchmarks/wgemm_mgpu_check.py --only "ks4 pairs bk512 st5 P,ks4 tm pairs bk512 st5 P,ks4 c2 pairs bk512 st5 P,ks4 c2 tm pairs bk512 st5 P,ks4 c4 tm pairs bk512 st5 P" --budget 330 --preflight-timeout 60 --out $OUT/wg >> $OUT/a_wgemm.txt 2>&1
grep "^preflight\|ratio\|FAIL" $OUT/a_wgemm.txt | cut -c1-250 | head -40
timeout 110 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/a_gpu_check_decode.txt 2>&1
tail -1 $OUT/a_gpu_check_decode.txt; grep FAIL $OUT/a_gpu_check_decode.txt | cut -c1-300 | head -3
