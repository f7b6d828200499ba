# issue 32: the batch-1 step is host-bound (c26: the GPU busy 56% of it). Do inductor's own launch levers take host
# time off the compiled decoder layers? Plain; the C++ wrapper (kernel launches from generated C++ instead of
# Python, TORCHINDUCTOR_CPP_WRAPPER=1); inductor's CUDA graphs of each compiled layer (TORCHINDUCTOR_CUDAGRAPHS=1,
# as mode="reduce-overhead": it may skip layers it cannot graph, and says why in the log). Batch 1, 20 timed steps
# each, nf4 first.
echo "== c34: batch 1, inductor's C++ wrapper and CUDA graphs"
for base in ${BASES:-nf4 bf16}; do
  for variant in plain TORCHINDUCTOR_CPP_WRAPPER TORCHINDUCTOR_CUDAGRAPHS; do
    t=$(( END - $(date +%s) ))
    if [ $t -lt 90 ]; then echo "-- skipped (no time): $base $variant"; continue; fi
    echo "-- $base, $variant"
    env $([ $variant = plain ] || echo "$variant=1") timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile --bases $base --batches 1 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 20 --deadline $(( t - 10 )) --json $OUT/b1-$variant.jsonl
  done
done
