# issue 28: the step-0 previews' peak, and the first step's reserve after the previews and evaluation. c43's
# previews phase peaked at 12.45 GiB (whole process) where the run's estimate counts 11.50: the UNet's cached blocks
# stayed reserved beside the decode's; render now gives them back after the last denoising step. c43's fresh run
# reserved 23.3 GiB by its first step where its relaunch (previews and eval from the cache) reserved 17.33: the
# blocks the default stream had cached for the previews' and eval's activations stayed reserved beside the warm-up's
# side stream and the graphs' pool. GraphedCall now empties the cache before a capture. One fresh 60-step batch-2
# run: its step-1 reserve (gpu_peak_gib) and the whole process's peak by phase ("previews before" against the
# estimate's "previews").
echo "== c47: the first capture after the step-0 previews and evaluation"
t=$(( END - $(date +%s) ))
timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --steps 60 --warmup 10 --set "data.cache_dir='/tmp/e2e/cache-c47'" --json $OUT/runs.jsonl
grep -h '"step": 1,' /tmp/e2e/runs/defaults-b2/events.jsonl | tee $OUT/step1.txt
cp /tmp/e2e/runs/defaults-b2/events.jsonl $OUT/defaults-b2.events.jsonl 2>/dev/null
cp /tmp/e2e/runs/defaults-b2/train.log $OUT/defaults-b2.train.log 2>/dev/null
true
