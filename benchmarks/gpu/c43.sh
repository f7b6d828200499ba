# issue 28: evaluation without cuDNN's algorithm search (speed.cudnn_search around evaluate's UNet calls, as the
# previews already ran). eval_cost.py: evaluation's calls (one a bucket, a batch's images at four timesteps) with
# the search off, on for the first time, on again, at batch 2 and 4. Then the product path at the default batch:
# a 60-step run to its end, fresh then relaunched: the eval before (not cached in the first) and the finish phase
# (the final eval, the export, the final previews; c38 measured 12.9 s fresh and 24.6 s relaunched with the search
# on, where the relaunch's final eval paid the search its cached eval before had not).
echo "== c43: evaluation without cuDNN's search"
[ -d /tmp/e2e/sdxl-random ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import train_e2e as t; t.build_model(Path('/tmp/e2e/sdxl-random'), tiny=False)"
for b in 2 4; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 60 ]; then echo "-- skipped (no time): eval_cost batch $b"; continue; fi
  timeout $t python3 benchmarks/eval_cost.py --model /tmp/e2e/sdxl-random --batch $b | tee -a $OUT/eval_cost.jsonl
done
t=$(( END - $(date +%s) ))
if [ $t -ge 200 ]; then
  timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --steps 60 --warmup 10 --again --set "model.cache_dir='/tmp/e2e/cache-c43'" --json $OUT/runs.jsonl
  grep -h "eval loss\|previews at step" /tmp/e2e/runs/defaults-b2*/train.log | tee $OUT/eval-lines.txt
else
  echo "-- skipped (no time): the batch-2 runs"
fi
true
