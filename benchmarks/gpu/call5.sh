set -o pipefail
START=$(date +%s)
export END=$(( START + ${BUDGET:-570} ))
source benchmarks/gpu/setup.sh
bash benchmarks/gpu/c34.sh
echo "elapsed $(( $(date +%s) - START )) s"
