source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c54.sh
echo "elapsed $(( $(date +%s) - START )) s"
