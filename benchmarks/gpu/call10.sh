source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c38.sh
echo "elapsed $(( $(date +%s) - START )) s"
