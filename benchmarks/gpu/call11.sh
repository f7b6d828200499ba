source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c39.sh
echo "elapsed $(( $(date +%s) - START )) s"
