# issue 32: train.cuda_graphs at batch 4 (c41 measured batch 1: 1.71x on a slow host): nf4, no checkpointing,
# compiled layers, 8-bit AdamW, the embedding on the host, without then with the graphs, 20 timed steps each;
# whether the setting pays where the GPU is busy, and what it holds beside the step.
echo "== c44: train.cuda_graphs for the LLM at batch 4"
for graphs in false true; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 100 ]; then echo "-- skipped (no time): cuda_graphs=$graphs"; continue; fi
  echo "-- ours-compile, batch 4, train.cuda_graphs=$graphs"
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-compile --bases nf4 --batches 4 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --set train.cuda_graphs=$graphs --steps 20 --deadline $(( t - 10 )) --json $OUT/graphs-b4.jsonl
done
true
