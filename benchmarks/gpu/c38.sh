# issue 28: "a 300-step run spends at most 10% of its time rendering previews" was measured at batch 16. At the
# default batch (2) and at 4 a 300-step run is much shorter, and the previews before and after cost the same: a
# whole 300-step run each (no Ctrl-C), the default previews on: batch 2 on a fresh machine and relaunched, then 4.
echo "== c38: the previews' share of whole 300-step runs"
for args in "--batch 2 --again" "--batch 4"; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 120 ]; then echo "-- skipped (no time): $args"; continue; fi
  echo "-- $args"
  timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults $args --steps 300 --warmup 10 --json $OUT/previews.jsonl
done
true
