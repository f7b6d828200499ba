source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c34.sh
echo "elapsed $(( $(date +%s) - START )) s"
