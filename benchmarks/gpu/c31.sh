# issue 28: batch 4 through the CLI, a cold launch then the warm relaunch
echo "== c31: b4 launch, cold then warm"
timeout $(( END - $(date +%s) - ${RESERVE:-150} )) python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 4 --steps 30 --warmup 6 --run-steps 300 --again --json $OUT/b4g.jsonl
