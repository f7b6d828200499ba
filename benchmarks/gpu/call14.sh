source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c42.sh
echo "elapsed $(( $(date +%s) - START )) s"
