source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c47.sh
bash benchmarks/gpu/c44.sh
echo "elapsed $(( $(date +%s) - START )) s"
