#!/bin/bash
# session 10 run d: the "lanes" decode (nibbles regrouped per word: mask + multiply per output
# register) against "pairs", with and without decode-in-parts (chunks), 4 and 2 compute warpgroups;
# pairs with bfloat16 scales; every variant checked against backend "xla" before it is timed
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/d_wgemm.txt 2>&1
timeout 500 python benchmarks/wgemm_mgpu_check.py --only "ks4 pairs bk512 st5 P,ks4 ch2 pairs bk512 st5 P,ks2 ch2 pairs bk512 st5 P,ks4 pairs bk512 st5 P B,ks4 ch2 pairs bk512 st5 P B,ks4 lanes bk512 st5 L,ks4 ch2 lanes bk512 st5 L,ks2 ch2 lanes bk512 st5 L" --budget 420 --preflight-timeout 60 --out $OUT/wg >> $OUT/d_wgemm.txt 2>&1
grep "^preflight\|^  M=\|FAIL" $OUT/d_wgemm.txt | cut -c1-250 | head -40
grep -c "ok=True" $OUT/d_wgemm.txt
