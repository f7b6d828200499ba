# issue 28: after 2a5a911 (the training steps' CUDA graphs released before the final evaluation and previews) a
# whole 300-step run at the default batch (2), on a fresh machine then relaunched: the finish phase's peak against
# the run's estimate (session 39: 23.88 GiB against 19.67 before the change), and the previews' share from each
# set's own timing (the previews_rendered events: rendering, the VAE's moves and the merge, writing), with the
# trainer's previews now batched on the GPU (memory.PREVIEW_BATCH, not measured before). Then preview_cost.py:
# three same-size prompts one a call against one call of three (render's batch), with the trainer's merged
# adapter set beside them (--levers): whether the batch pays, and its peak.
echo "== c40: batch 2 whole runs after the graphs' release; a preview set batched"
t=$(( END - $(date +%s) ))
if [ $t -ge 150 ]; then
  timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --again --steps 300 --warmup 10 --json $OUT/previews.jsonl
  grep -h "previews at step\|CUDA graphs released" /tmp/e2e/runs/defaults-b2*/train.log | tee $OUT/preview-lines.txt
else
  echo "-- skipped (no time): the batch-2 runs"
fi
t=$(( END - $(date +%s) ))
if [ $t -ge 90 ]; then
  timeout $t python3 benchmarks/preview_cost.py --model /tmp/e2e/sdxl-random --levers --batch 3 | tee $OUT/preview_cost.jsonl
else
  echo "-- skipped (no time): preview_cost"
fi
true
