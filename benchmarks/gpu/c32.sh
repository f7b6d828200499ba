# issue 28: where a warm relaunch's seconds go. A batch-4 run warms the caches (latents, texts, step-0 previews
# and eval loss, inductor), then the same run again plain and once more under cProfile; each log's timestamps
# and the profile's cumulative table come back.
echo "== c32: b4 warm relaunch, plain and profiled"
timeout $(( END - $(date +%s) - 100 )) python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 4 --steps 30 --warmup 6 --run-steps 300 --again --json $OUT/b4w.jsonl
t=$(( END - $(date +%s) - 5 ))
if [ $t -gt 60 ]; then
  timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 4 --steps 12 --warmup 4 --run-steps 300 --profile --json $OUT/b4p.jsonl
fi
mkdir -p $OUT/c32 && cp /tmp/e2e/runs/*.log /tmp/e2e/runs/*.prof.txt $OUT/c32/ 2>/dev/null
for r in /tmp/e2e/runs/defaults-b4*/; do cp $r/events.jsonl $OUT/c32/$(basename $r).events.jsonl 2>/dev/null; done
true
