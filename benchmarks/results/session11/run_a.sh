#!/bin/bash
# session 11 run a: the "lanes" decode with one multiply for x 2^126 x scale (fold_scale), with each
# step's WGMMAs waited one step late (delay_release), and both, against session 10's default
# ("ks4 ch2 lanes"); every variant checked against backend "xla" (and every E8M0 byte) before timing
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/a_wgemm.txt 2>&1
timeout 540 python benchmarks/wgemm_mgpu_check.py --only "ks4 ch2 lanes bk512 st5 L,ks4 ch2 lanes fold L,ks4 ch2 lanes delay L,ks4 ch2 lanes fold delay L,ks2 ch2 lanes fold delay L" --budget 440 --preflight-timeout 60 --ptxas-log --out $OUT/wg >> $OUT/a_wgemm.txt 2>&1
grep "^preflight\|^  M=\|FAIL\|spill\|registers" $OUT/a_wgemm.txt | cut -c1-250 | head -50
grep -c "ok=True" $OUT/a_wgemm.txt
