# issue 28: the warm relaunch with the first step's backward convolutions searched ahead (core/conv_search.py): the
# fresh run records them, each relaunch replays them on a thread at launch; relaunches with the replay off
# (train.reuse_conv_search=false) alternate with it on. Batch 2 (the launch goal's run), then batch 8 for the
# memory the replay's choices leave (its hold keeps the recorded step's memory in use). Byte-code present as in c50.
echo "== c52: the relaunch with cuDNN's backward search done ahead"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
records() { python3 -c "
import glob, json, collections
for p in sorted(glob.glob('/tmp/e2e/runs/.cache/conv-search/*.json')):
    r = json.load(open(p)); c = collections.Counter(tuple(x['mask']) for x in r['calls'])
    print(p.rsplit('/', 1)[1], r['gpu'], 'cudnn', r['cudnn'], len(r['calls']), 'calls', dict(c))"; }
RUN="python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 30 --warmup 10 --set preview.after=false --json $OUT/runs.jsonl"
OFF="--set train.reuse_conv_search=false"
keep() { cp /tmp/e2e/runs/defaults-b$1/train.log $OUT/$2.train.log 2>/dev/null; }
t=$(( END - $(date +%s) ))
timeout $t $RUN --batch 2 | grep -v '^\$'; keep 2 b2-fresh; records
for way in on off on off; do
  t=$(( END - $(date +%s) )); [ $t -ge 60 ] || break
  echo "-- batch 2 relaunch, replay $way"
  if [ $way = on ]; then timeout $t $RUN --batch 2 | grep -v '^\$'; else timeout $t $RUN --batch 2 $OFF | grep -v '^\$'; fi
  keep 2 b2-$way-$(date +%s)
done
t=$(( END - $(date +%s) ))
if [ $t -ge 200 ]; then
  echo "-- batch 8: fresh (records), relaunch with the replay, relaunch without"
  timeout $t $RUN --batch 8 | grep -v '^\$'; keep 8 b8-fresh; records
  t=$(( END - $(date +%s) )); timeout $t $RUN --batch 8 | grep -v '^\$'; keep 8 b8-on
  t=$(( END - $(date +%s) )); [ $t -ge 60 ] && { timeout $t $RUN --batch 8 $OFF | grep -v '^\$'; keep 8 b8-off; }
fi
true
