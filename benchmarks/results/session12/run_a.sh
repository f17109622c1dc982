#!/bin/bash
# session 12 run a: the large-tile Mosaic GPU w4a16 kernel (decode in the GEMM's K loop,
# jax_mxfp4/kernels/wgemm_tiles_mgpu.py): each tiling checked alone (timeout: a hang costs one
# variant) against a float64 reference on rows of every tile, then timed beside bf16 and the
# two-pass route at 1024x8192x8192 (and 8192^3)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $OUT/a_info.txt 2>&1
ok=""
for v in tiles tiles-128x64 tiles-256x64 tiles-128x128-nofold tiles-256x128-s2; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 75 python $P --shapes 1024x8192x8192 --only $v --check-only --out $OUT/chk > $OUT/a_chk_$v.txt 2>&1
  rc=$?
  line=$(grep -E "^ +1024x8192x8192 $v " $OUT/a_chk_$v.txt | head -1)
  echo "$v rc=$rc :: $(echo $line | cut -c1-200)"
  grep -i "spill\|registers" $OUT/a_chk_$v.txt | sort | uniq -c | head -3
  if echo "$line" | grep -q " True "; then ok="$ok,$v"; fi
done
echo "passed:$ok"
# edges: partial last M tile and f32 output; scale bytes > 128 (two-multiply side); small scales
timeout 60 python $P --shapes 1000x4096x2048 --only tiles,pallas-prepared --check-only --out $OUT/chk2 > $OUT/a_chk_edge.txt 2>&1; echo "edge rc=$?"
timeout 60 python $P --shapes 520x2048x1024 --only tiles,tiles-256x64 --check-only --w-exp 40 --out $OUT/chk3 >> $OUT/a_chk_edge.txt 2>&1; echo "big rc=$?"
timeout 60 python $P --shapes 264x2048x1024 --only tiles --check-only --w-exp -100 --out $OUT/chk4 >> $OUT/a_chk_edge.txt 2>&1; echo "small rc=$?"
grep -E "^ +[0-9]+x" $OUT/a_chk_edge.txt | grep -v bf16 | cut -c1-200
[ -z "$ok" ] && exit 0
timeout 240 python $P --shapes 1024x8192x8192 --only bf16,pallas${ok},pallas-prepared --out $OUT/t1 > $OUT/a_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x" $OUT/a_time.txt | cut -c1-250
timeout 120 python $P --shapes 8192x8192x8192 --only bf16,pallas,tiles,pallas-prepared --out $OUT/t2 > $OUT/a_time2.txt 2>&1; echo "time2 rc=$?"
grep -E "^ +[0-9]+x" $OUT/a_time2.txt | cut -c1-250
