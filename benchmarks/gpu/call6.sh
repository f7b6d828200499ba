source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c35.sh
echo "elapsed $(( $(date +%s) - START )) s"
