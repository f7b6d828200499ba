source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c52.sh
echo "elapsed $(( $(date +%s) - START )) s"
