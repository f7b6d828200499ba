source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c41.sh
echo "elapsed $(( $(date +%s) - START )) s"
