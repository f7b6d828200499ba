# issue 32: the offloaded layer inputs exactly the inputs on the GPU's streams? then what the overlap gains
# END (epoch seconds) bounds the rows; each row gets what is left.
echo "== c24: offload exactness"
END=${END:-$(( $(date +%s) + 560 ))}
for extra in "" "--delay-ms 5" "--compile --delay-ms 5" "--steps 1 --time 10 --attention sdpa"; do
  t=$(( END - $(date +%s) ))
  if [ $t -lt 40 ]; then echo "-- skipped (no time): $extra"; continue; fi
  echo "-- offload_check $extra (timeout $t s)"
  timeout $t python3 benchmarks/offload_check.py --layers 8 --batch 4 --seq 2048 --steps 3 $extra | tee -a $OUT/offload.jsonl
done
