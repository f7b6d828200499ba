source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c43.sh
echo "elapsed $(( $(date +%s) - START )) s"
