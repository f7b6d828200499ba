source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c47.sh
echo "elapsed $(( $(date +%s) - START )) s"
