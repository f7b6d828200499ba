source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c51.sh
echo "elapsed $(( $(date +%s) - START )) s"
