# issue 28 (run on the machine c52 left warm, /tmp/e2e and its record in place): the relaunch with the replay's
# hold on the process's reserved memory (the old hold given back first), between relaunches with the replay off.
R="python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 30 --warmup 10 --set preview.after=false --json $OUT/runs.jsonl --batch 2"
for w in on off on; do
  echo "-- replay $w"
  if [ $w = on ]; then timeout 70 $R | grep -v '^\$'; else timeout 70 $R --set train.reuse_conv_search=false | grep -v '^\$'; fi
  grep "cuDNN" /tmp/e2e/runs/defaults-b2/train.log | cut -c1-200
done
