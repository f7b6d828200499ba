# issue 32: train.cuda_graphs at batch 4 (c41 measured batch 1: 1.71x on a slow host): nf4, no checkpointing,
# compiled layers, 8-bit AdamW, the embedding on the host, without then with the graphs, 20 timed steps each;
# whether the setting pays where the GPU is busy, and what it holds beside the step. Then batch 1 with the setting
# left to train.speed="auto" (which turns it on for steps of at most 2,048 tokens): the run's speed event and its
# tokens/s beside c41's.
echo "== c44: train.cuda_graphs for the LLM at batch 4; auto's choice at batch 1"
for graphs in false true; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 100 ]; then echo "-- skipped (no time): cuda_graphs=$graphs"; continue; fi
  echo "-- ours-compile, batch 4, train.cuda_graphs=$graphs"
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-compile --bases nf4 --batches 4 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --set train.cuda_graphs=$graphs --steps 20 --deadline $(( t - 10 )) --json $OUT/graphs-b4.jsonl
done
t=$(( END - $(date +%s) ))
if [ $t -ge 100 ]; then
  echo "-- ours-compile, batch 1, train.cuda_graphs left to auto"
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-compile --bases nf4 --batches 1 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 20 --deadline $(( t - 10 )) --json $OUT/graphs-b1-auto.jsonl
  grep -h "train.speed='auto'\|decoder layers compiled" /tmp/llmc/runs/ours-compile-nf4-b1/train.log | tee $OUT/auto-lines.txt
else
  echo "-- skipped (no time): batch 1, auto"
fi
true
