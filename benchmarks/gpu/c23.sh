# issue 32: ours (offload, compiled, 8-bit AdamW, embedding on the host) and unsloth, 30 steps, two turns; segments
echo "== c23: ours vs unsloth"
mkdir -p /tmp/us && tar -xzf .whl-us/us.tgz -C /tmp/us
END=${END:-$(( $(date +%s) + 560 ))}
for base in ${BASES:-bf16 nf4}; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 120 ]; then echo "-- skipped (no time): $base"; continue; fi
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile unsloth --unsloth-site /tmp/us --bases $base --batches 4 --repeat ${REPEAT:-2} --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 30 --deadline $(( t - 20 )) --json $OUT/llm.jsonl
done
