source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c50.sh
echo "elapsed $(( $(date +%s) - START )) s"
