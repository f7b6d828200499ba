# issue 32: how busy the GPU is in a batch-1 step
echo "== c26: b1 nf4 profile"
timeout 300 python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile --bases nf4 --batches 1 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --set train.profile_steps=2 --steps 4 --json $OUT/prof-b1.jsonl
