# issue 32: `llm plan` against the measured peak at 8,192 tokens with the current loss (session 16 measured it
# before the chunked loss: +3%): Llama-3-8B (random weights), nf4, batch 1 x 8192, checkpointing, beside the plan's
# estimate for the same settings (config only).
echo "== c45: llm plan against the measured peak at 8,192 tokens"
t=$(( END - $(date +%s) ))
if [ $t -ge 120 ]; then
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --seq 8192 --only ours-ckpt --bases nf4 --batches 1 --steps 3 --warmup 1 --deadline $(( t - 20 )) --json $OUT/seq8k.jsonl
  python3 -m sdxl_lora.cli llm plan --json --model /tmp/llmc/llama-llama3-8b-random --batch-size 1 --max-length 8192 --rank 16 --set "adapter.preset='full'" --set train.gradient_checkpointing=true --set "model.quantize='nf4'" > $OUT/plan-8k-nf4.json && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('plan nf4 8k', {k: d[k] for k in ('memory_gib', 'peak_gib', 'process_peak_gib')})" $OUT/plan-8k-nf4.json
else
  echo "-- skipped (no time): the 8k run"
fi
true
