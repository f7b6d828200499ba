# issue 32: the batch-1 step is host-bound, and inductor's CUDA graphs could not capture the compiled layers
# with their inputs offloaded (c34: the capture invalidated; each input's copy runs on a side stream around the
# layer). At batch 1 the card has room for the inputs: the compiled layers under checkpointing alone
# (ours-ckpt-compile) and with no checkpointing (ours-compile), plain and with TORCHINDUCTOR_CUDAGRAPHS=1; nf4,
# 8-bit AdamW, the embedding on the host, 20 timed steps each.
echo "== c37: batch 1, inductor's CUDA graphs without the offloaded inputs"
for contender in ours-ckpt-compile ours-compile; do
  for variant in plain TORCHINDUCTOR_CUDAGRAPHS; do
    t=$(( END - $(date +%s) ))
    if [ $t -lt 90 ]; then echo "-- skipped (no time): $contender $variant"; continue; fi
    echo "-- $contender, $variant"
    env $([ $variant = plain ] || echo "$variant=1") timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only $contender --bases nf4 --batches 1 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 20 --deadline $(( t - 10 )) --json $OUT/b1-$contender-$variant.jsonl
  done
done
true
