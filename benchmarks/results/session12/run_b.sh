#!/bin/bash
# session 12 run b: larger tiles of the large-tile w4a16 kernel with setmaxnreg (run a: mt 256
# spilled at 166 registers): 256 activation rows (bk 64 / 128), 2 weight tiles per warpgroup
# (256 weight rows per CTA); each checked alone first, then timed beside bf16 and the two-pass
# route at 1024x8192x8192; the fastest then at 2048, 4096 and 8192 rows (where two-pass wins)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
ok=""
for v in tiles-128x128-r tiles-256x64-r tiles-256x128-s2-r tiles-128x128-w2-r tiles-128x64-w2-r tiles-256x64-s3-r; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 75 python $P --shapes 1024x8192x8192 --only $v --check-only --out $OUT/chk > $OUT/b_chk_$v.txt 2>&1
  rc=$?
  line=$(grep -E "^ +1024x8192x8192 $v " $OUT/b_chk_$v.txt | head -1)
  echo "$v rc=$rc :: $(echo $line | cut -c1-200)"
  grep -i "spill\|registers" $OUT/b_chk_$v.txt | sort | uniq -c | head -3
  if echo "$line" | grep -q " True "; then ok="$ok,$v"; fi
done
echo "passed:$ok"
cat $OUT/b_chk_*.txt > $OUT/b_chk_all.txt; rm $OUT/b_chk_tiles*.txt
[ -z "$ok" ] && exit 0
timeout 60 python $P --shapes 1000x4096x2048 --only ${ok#,} --check-only --out $OUT/chk2 > $OUT/b_chk_edge.txt 2>&1; echo "edge rc=$?"
timeout 60 python $P --shapes 520x2048x1024 --only ${ok#,} --check-only --w-exp 40 --out $OUT/chk3 >> $OUT/b_chk_edge.txt 2>&1; echo "big rc=$?"
grep -E "^ +[0-9]+x" $OUT/b_chk_edge.txt | grep -v bf16 | cut -c1-200
timeout 240 python $P --shapes 1024x8192x8192 --only bf16,pallas,tiles${ok} --out $OUT/t1 > $OUT/b_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x" $OUT/b_time.txt | cut -c1-250
best=$(python - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/t1/xla_dequant_probe.json"))["rows"]
t = [(r["kernel_s"], r["variant"]) for r in rows if r["variant"].startswith("tiles") and r.get("ok") and r.get("kernel_s")]
print(min(t)[1] if t else "tiles")
PY
)
echo "best: $best"
timeout 200 python $P --shapes 2048x8192x8192,4096x8192x8192,8192x8192x8192 --only bf16,pallas,$best --out $OUT/t2 > $OUT/b_time2.txt 2>&1; echo "time2 rc=$?"
grep -E "^ +[0-9]+x" $OUT/b_time2.txt | cut -c1-250
