# issue 32: `llm plan` within 15% of the measured peak at 1k tokens (2k and 8k were measured in session 30):
# Llama-3-8B (random weights), rows of 1,024 tokens, batch 4, checkpointing and compiled layers, nf4 then bf16;
# each run's measured peaks beside the plan's estimate for the same settings (config only).
echo "== c42: llm plan against the measured peak at 1,024 tokens"
for base in nf4 bf16; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 120 ]; then echo "-- skipped (no time): $base"; continue; fi
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --seq 1024 --only ours-ckpt-compile --bases $base --batches 4 --steps 10 --deadline $(( t - 20 )) --json $OUT/seq1k.jsonl
  quant=$([ $base = nf4 ] && echo "--set model.quantize='nf4'")
  python3 -m sdxl_lora.cli llm plan --json --model /tmp/llmc/llama-llama3-8b-random --batch-size 4 --max-length 1024 --rank 16 --set "adapter.preset='full'" --set train.gradient_checkpointing=true --set "train.compile='regional'" $quant > $OUT/plan-1k-$base.json && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('plan', sys.argv[2], {k: v for k, v in d.items() if 'gib' in k or k in ('memory', 'estimate')})" $OUT/plan-1k-$base.json $base
done
true
