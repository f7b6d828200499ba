source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c40.sh
echo "elapsed $(( $(date +%s) - START )) s"
