# issue 32: ours' whole-process memory with fixed-size allocator segments (PYTORCH_ALLOC_CONF=
# expandable_segments:False) instead of the expandable ones the CLI prefers: is ours' reserve over its allocated
# peak, larger than unsloth's (fixed segments; benchmarks/RESULTS.md, c23), the expandable segment's?
# Batch 4, one turn, the same settings as c23. Then issue 28: batch 1 through the CLI, for the memory
# estimate against the measured peak at a third batch size.
echo "== c35: ours with fixed-size segments"
for base in ${BASES:-bf16 nf4}; do
  t=$(( END - $(date +%s) - 150 ))
  if [ $t -lt 90 ]; then echo "-- skipped (no time): $base"; continue; fi
  PYTORCH_ALLOC_CONF=expandable_segments:False timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile --bases $base --batches 4 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 30 --deadline $(( t - 10 )) --json $OUT/llm-fixed.jsonl
done
echo "== c35: SDXL batch 1 through the CLI"
t=$(( END - $(date +%s) - 5 ))
if [ $t -gt 90 ]; then
  timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 1 --steps 20 --warmup 4 --run-steps 300 --json $OUT/b1.jsonl
fi
true
