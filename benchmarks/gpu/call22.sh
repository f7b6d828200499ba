source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c48.sh
bash benchmarks/gpu/c45.sh
bash benchmarks/gpu/c46.sh
echo "elapsed $(( $(date +%s) - START )) s"
