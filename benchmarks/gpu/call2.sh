source benchmarks/gpu/setup.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash benchmarks/gpu/c15.sh; else bash benchmarks/gpu/c23.sh; fi
echo "elapsed $(( $(date +%s) - START )) s"
