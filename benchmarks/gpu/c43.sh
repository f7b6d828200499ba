# issue 28: the previews' share and the finish phase after three changes: the dataset-caption previews at one size
# (the dataset's most common bucket), so the set renders in one pipeline call; evaluation without cuDNN's algorithm
# search (speed.cudnn_search around evaluate's UNet calls, as the previews already ran), and previews rendered by
# the bare UNet's modules (the adapter merged, its layers out, diffusers' attention processor: c40 measured the
# trainer's render at 5.5-9.1 s a set of three where the bare UNet's took 3.5-6.2). First the product path at the
# default batch: a 60-step run to its end, fresh (its own latent cache) then relaunched: the eval before (not cached
# in the first; its time and its phase's peak, as cuDNN's heuristics' plans can take larger workspaces), the finish
# phase (c38: 12.9 s fresh, 24.6 s relaunched with the search on, where the relaunch's final eval paid the search
# its cached eval before had not), each previews set's own timing. Then preview_cost.py --levers (the trainer's way
# of rendering beside the others) and eval_cost.py (evaluation's calls with the search on, then off, each in its own
# process; then the previews' bare set with the search on). STEPS=300 runs the issue's 300-step length instead of
# 60. RUNS=0 leaves the runs out (a call too short for them: the two levers' own timings only).
echo "== c43: evaluation without cuDNN's search; previews from the bare UNet's modules"
t=$(( END - $(date +%s) ))
if [ "${RUNS:-1}" = 0 ]; then
  echo "-- RUNS=0: the batch-2 runs left out"
  [ -d /tmp/e2e/sdxl-random ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import train_e2e as t; t.build_model(Path('/tmp/e2e/sdxl-random'), tiny=False)"
elif [ $t -ge 200 ]; then
  timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --steps ${STEPS:-60} --warmup 10 --again --set "data.cache_dir='/tmp/e2e/cache-c43'" --json $OUT/runs.jsonl
  grep -h "eval loss\|previews at step" /tmp/e2e/runs/defaults-b2*/train.log | tee $OUT/eval-preview-lines.txt
  for d in /tmp/e2e/runs/defaults-b2*/; do cp $d/train.log $OUT/$(basename $d).train.log; cp $d/events.jsonl $OUT/$(basename $d).events.jsonl; done
else
  echo "-- skipped (no time): the batch-2 runs"
fi
t=$(( END - $(date +%s) ))
if [ $t -ge 100 ]; then
  timeout $t python3 benchmarks/preview_cost.py --model /tmp/e2e/sdxl-random --levers | tee $OUT/preview_cost.jsonl
else
  echo "-- skipped (no time): preview_cost"
fi
for search in on off; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 60 ]; then echo "-- skipped (no time): eval_cost, search $search"; continue; fi
  timeout $t python3 benchmarks/eval_cost.py --model /tmp/e2e/sdxl-random --batch 2 --search $search | tee -a $OUT/eval_cost.jsonl
done
t=$(( END - $(date +%s) ))
if [ $t -ge 90 ]; then  # the bare UNet's set with the search on, in a process of its own, beside the rows above
  timeout $t python3 benchmarks/preview_cost.py --model /tmp/e2e/sdxl-random --search on | tee -a $OUT/preview_cost.jsonl
fi
true
