source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c55.sh
echo "elapsed $(( $(date +%s) - START )) s"
