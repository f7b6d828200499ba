source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c25.sh
echo "elapsed $(( $(date +%s) - START )) s"
bash benchmarks/gpu/c31.sh
echo "elapsed $(( $(date +%s) - START )) s"
bash benchmarks/gpu/c24.sh
echo "elapsed $(( $(date +%s) - START )) s"
