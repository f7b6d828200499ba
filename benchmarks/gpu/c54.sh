# issue 28: where a warm relaunch's seconds go now that the backward convolutions' search is replayed at launch:
# batch 2 fresh (records), relaunched plain, relaunched under cProfile (the main thread's table comes back with
# the logs). Then batch 8 (the memory check the replay's hold needs at a larger batch): fresh, relaunched with the
# replay, relaunched without it. Byte-code present as in c50.
echo "== c54: the relaunch's seconds; batch 8's memory with the replay"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
RUN="python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 30 --warmup 10 --set preview.after=false --json $OUT/runs.jsonl"
keep() { cp /tmp/e2e/runs/defaults-b$1/train.log $OUT/$2.train.log 2>/dev/null; }
t=$(( END - $(date +%s) ))
timeout $t $RUN --batch 2 | grep -v '^\$'; keep 2 b2-fresh
t=$(( END - $(date +%s) )); timeout $t $RUN --batch 2 | grep -v '^\$'; keep 2 b2-again
t=$(( END - $(date +%s) )); [ $t -ge 60 ] && { timeout $t $RUN --batch 2 --profile | grep -v '^\$'; keep 2 b2-prof; }
cp /tmp/e2e/runs/*.prof.txt /tmp/e2e/runs/*.prof $OUT/ 2>/dev/null
t=$(( END - $(date +%s) ))
if [ $t -ge 200 ]; then
  echo "-- batch 8: fresh (records), relaunch with the replay, relaunch without"
  timeout $t $RUN --batch 8 | grep -v '^\$'; keep 8 b8-fresh
  t=$(( END - $(date +%s) )); timeout $t $RUN --batch 8 | grep -v '^\$'; keep 8 b8-on
  t=$(( END - $(date +%s) )); [ $t -ge 60 ] && { timeout $t $RUN --batch 8 --set train.reuse_conv_search=false | grep -v '^\$'; keep 8 b8-off; }
fi
true
