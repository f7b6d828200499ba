# issue 32: the offloaded layer inputs without record_stream (a layer's input stays referenced until the next
# layer has the compute stream wait for its copy; an input brought back is waited for before use): still bitwise
# the kept ones with the side stream held back before every copy, both ways? Then ours at batch 4 as in c23 (one
# turn, nf4 then bf16): does the reserve over the allocated peak shrink (against c23's)?
# Last, the exactness check with compiled layers, as time allows.
check() {
  t=$(( END - $(date +%s) ))
  if [ $t -lt 40 ]; then echo "-- skipped (no time): offload_check $*"; return; fi
  echo "-- offload_check $*"
  timeout $t python3 benchmarks/offload_check.py --layers 8 --batch 4 --seq 2048 --steps 3 "$@" | tee -a $OUT/offload.jsonl
}
echo "== c36: offload exactness without record_stream, then ours at batch 4"
check --delay-ms 5
for base in ${BASES:-nf4 bf16}; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 80 ]; then echo "-- skipped (no time): $base"; continue; fi
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours-offload-compile --bases $base --batches 4 --set "train.optimizer='adamw8bit'" --set llm.offload_embeddings=true --steps 30 --deadline $(( t - 10 )) --json $OUT/llm.jsonl
done
check --compile --delay-ms 5
true
