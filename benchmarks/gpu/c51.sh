# issue 28: a run started from the UI's queue with the worker kept ready (ui/jobs.py: standby), beside one whose
# process starts when it is queued, on the full-size folder and the 3-bucket dataset, the caches warm from the
# CLI runs before it; byte-code present as in c50. First the CLI's fresh run and relaunch with the UNet read through
# one staging buffer (the read of e2e1d5b left 0.25 GiB more reserved than the serial read's).
echo "== c51: the UI's launch with a worker kept ready; the CLI relaunch after the staging read"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
t=$(( END - $(date +%s) ))
timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --steps 30 --warmup 10 --set preview.after=false --again --json $OUT/runs.jsonl | grep -v '^\$'
for d in /tmp/e2e/runs/defaults-b2*/; do cp $d/train.log $OUT/$(basename $d).train.log; done
t=$(( END - $(date +%s) ))
if [ $t -ge 120 ]; then
  timeout $t python3 benchmarks/ui_launch.py --work /tmp/e2e --batch 2 --steps 30 --turns 2 --json $OUT/ui.jsonl
  cp /tmp/e2e/ui-runs/*/train.log $OUT/ 2>/dev/null; for d in /tmp/e2e/ui-runs/*/; do cp $d/train.log $OUT/ui-$(basename $d).train.log; done
fi
true
