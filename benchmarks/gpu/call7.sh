source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c36.sh
echo "elapsed $(( $(date +%s) - START )) s"
