# issue 32: the batch-1 step is host-bound (c26: the GPU busy 56% of it). Does inductor's C++ wrapper (kernel
# launches from generated C++ instead of Python, TORCHINDUCTOR_CPP_WRAPPER=1) take host time off the compiled
# layers? nf4 and bf16 at batch 1, plain then with the wrapper, 20 timed steps each, in turns.
echo "== c34: batch 1, inductor's C++ wrapper"
for base in ${BASES:-nf4 bf16}; do
  for wrapper in 0 1; do
    t=$(( END - $(date +%s) ))
    if [ $t -lt 90 ]; then echo "-- skipped (no time): $base wrapper=$wrapper"; continue; fi
    echo "-- $base, TORCHINDUCTOR_CPP_WRAPPER=$wrapper"
    TORCHINDUCTOR_CPP_WRAPPER=$wrapper timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile --bases $base --batches 1 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 20 --deadline $(( t - 10 )) --json $OUT/b1-wrapper.jsonl
  done
done
