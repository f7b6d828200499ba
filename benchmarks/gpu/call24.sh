source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c49.sh
echo "elapsed $(( $(date +%s) - START )) s"
