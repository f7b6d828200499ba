source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c37.sh
echo "elapsed $(( $(date +%s) - START )) s"
