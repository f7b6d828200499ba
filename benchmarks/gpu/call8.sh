source benchmarks/gpu/setup.sh
# issue 32: the offloaded inputs without record_stream (7aa9529) with compiled layers, both copies held back 5 ms;
# then ours and unsloth side by side on one machine (c23), the whole-process peaks after that change
echo "== offload_check --compile --delay-ms 5"
timeout 120 python3 benchmarks/offload_check.py --layers 8 --batch 4 --seq 2048 --steps 3 --compile --delay-ms 5 | tee -a $OUT/offload.jsonl
bash benchmarks/gpu/c23.sh
echo "elapsed $(( $(date +%s) - START )) s"
