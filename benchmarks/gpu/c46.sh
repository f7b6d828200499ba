# issue 32: the LLM's preview answers with the adapter merged and its layers out of the model (the trainer's way
# since this change) against peft's layers and the merge alone: Llama-3-8B (random weights), the default three
# prompts, 48 new tokens each, bf16 then nf4 (whose 4-bit layers keep their adapter: the layers out only where
# merged).
echo "== c46: the LLM's preview answers, three ways"
[ -f /tmp/llmc/llama-llama3-8b-random/config.json ] || python3 -c "import sys, argparse; sys.path.insert(0, 'benchmarks'); import llm_compare as c; c.build_folder(argparse.Namespace(work='/tmp/llmc', model_shape='llama3-8b'))"
for q in none nf4; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 60 ]; then echo "-- skipped (no time): quantize $q"; continue; fi
  HF_HUB_OFFLINE=1 timeout $t python3 benchmarks/llm_preview_cost.py --model /tmp/llmc/llama-llama3-8b-random --quantize $q | tee -a $OUT/llm_preview.jsonl
done
true
