# issue 32: the offloaded layer inputs without record_stream (a layer's input stays referenced until the next
# layer has the compute stream wait for its copy; an input brought back is waited for before use): still bitwise
# the kept ones with the side stream held back before every copy, both ways? Then ours at batch 4 as in c23 (one
# turn, nf4 then bf16): does the reserve over the allocated peak shrink (c23, session 38: 0.78 / 0.59 GiB)?
echo "== c36: offload exactness without record_stream"
for extra in "--delay-ms 5" "--compile --delay-ms 5"; do
  t=$(( END - $(date +%s) - 140 ))
  if [ $t -lt 40 ]; then echo "-- skipped (no time): $extra"; continue; fi
  echo "-- offload_check $extra"
  timeout $t python3 benchmarks/offload_check.py --layers 8 --batch 4 --seq 2048 --steps 3 $extra | tee -a $OUT/offload.jsonl
done
echo "== c36: ours at batch 4"
for base in ${BASES:-nf4 bf16}; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 80 ]; then echo "-- skipped (no time): $base"; continue; fi
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile --bases $base --batches 4 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 30 --deadline $(( t - 10 )) --json $OUT/llm.jsonl
done
true
