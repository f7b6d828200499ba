# issue 30: LoKr at batch 16 beside plain LoRA, graphs only, previews off (H200)
echo "== c15: LoKr b16"
timeout $(( END - $(date +%s) )) python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults lokr --batch 16 --steps 20 --warmup 4 --run-steps 300 --set "train.compile='none'" --set "preview.prompts=''" --json $OUT/kinds.jsonl
