# issue 32: train.cuda_graphs for a causal LM (inductor's CUDA graphs of the compiled decoder layers, which
# c37 measured through TORCHINDUCTOR_CUDAGRAPHS=1 at 1.094x): the setting itself at batch 1 without checkpointing
# (nf4, 8-bit AdamW, the embedding on the host), beside the same run without it, 20 timed steps each.
echo "== c41: train.cuda_graphs for the LLM at batch 1"
for graphs in false true; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 90 ]; then echo "-- skipped (no time): cuda_graphs=$graphs"; continue; fi
  echo "-- ours-compile, train.cuda_graphs=$graphs"
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-compile --bases nf4 --batches 1 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --set train.cuda_graphs=$graphs --steps 20 --deadline $(( t - 10 )) --json $OUT/graphs.jsonl
done
true
