#!/bin/bash
# session 13 run c: (1) the helper's quantizer variants side by side with the same run's copy
# (quant_variants.sh: each variant bit-exact against the reference on the device before timing);
# (2) gpu_check --wgemm-only on the final w4a16 code (natural decode's bk-128 default, plain
# weights two-pass from 2048 rows); (3) dot_general at 512..2048 rows: bf16, plain weight (auto),
# plain weight with the Mosaic routes off (two-pass)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/q
OUT=$OUT/q bash benchmarks/results/session13/quant_variants.sh > $OUT/c_quant_console.txt 2>&1; echo "quant rc=$?"
grep -E "exit:|x copy|FAIL|Error|error" $OUT/c_quant_console.txt | head -20
(cd $OUT && tar czf c_quant.tgz q) && rm -rf $OUT/q
timeout 220 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/c_gpu_check_wgemm.txt 2>&1; echo "gpu_check rc=$?"
grep "FAIL" $OUT/c_gpu_check_wgemm.txt | cut -c1-200 | head; tail -1 $OUT/c_gpu_check_wgemm.txt
cp $OUT/gc/*.json $OUT/c_gpu_check.json 2>/dev/null
timeout 150 python benchmarks/xla_dequant_probe.py --shapes 1024x8192x8192,2048x8192x8192,512x8192x8192 --only bf16,pallas,pallas-two-pass --out $OUT/t1 > $OUT/c_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x|bad" $OUT/c_time.txt | cut -c1-250
cp $OUT/t1/xla_dequant_probe.json $OUT/c_time.json
rm -rf $OUT/t1 $OUT/gc
