source benchmarks/gpu/setup.sh
( export END=$(( END - 200 )); bash benchmarks/gpu/c33.sh )
echo "elapsed $(( $(date +%s) - START )) s"
BASES=nf4 REPEAT=1 bash benchmarks/gpu/c23.sh
echo "elapsed $(( $(date +%s) - START )) s"
