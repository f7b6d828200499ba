# issues 28 and 32's memory estimate with a quantized base: QLoRA by default (nf4, the defaults otherwise) at
# batch 1 through the CLI on a fresh machine, a whole 100-step run with the default previews before and after:
# images/s (goal: at least 8 on the H200), launch to first step, each phase's whole-process peak beside the run's
# estimate (with a 4-bit base the previews phase can be the run's peak; it holds no merged copies).
echo "== c49: QLoRA by default at batch 1, a whole run"
t=$(( END - $(date +%s) ))
timeout $t python3 benchmarks/train_e2e.py --work /tmp/e2e --settings qlora --batch 1 --steps 100 --warmup 10 --json $OUT/qlora.jsonl
grep -h '"step": 1,' /tmp/e2e/runs/qlora-b1/events.jsonl | tee $OUT/step1.txt
cp /tmp/e2e/runs/qlora-b1/train.log $OUT/qlora-b1.train.log 2>/dev/null
true
