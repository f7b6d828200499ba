# issue 32: compiled runs pad unpacked batches to the narrowest of max_length, /2, /4, /8 that holds the longest row
# (5aa94ee; before, every row went to max_length). On rows of lengths spread from 64 to 2048 tokens, bf16, batch 4,
# checkpointing: packing off uncompiled (each batch padded to its longest row), packing off compiled (the widths),
# and packing on compiled (full rows), 30 timed steps each; tokens/s counts the non-padding tokens.
echo "== c39: unpacked rows, compiled with a few widths"
for run in "ours-ckpt|llm.packing=false" "ours-ckpt-compile|llm.packing=false" "ours-ckpt-compile|llm.packing=true"; do
  contender=${run%%|*}; packing=${run##*|}
  t=$(( END - $(date +%s) ))
  if [ $t -lt 90 ]; then echo "-- skipped (no time): $run"; continue; fi
  echo "-- $contender, $packing"
  timeout $t python3 benchmarks/llm_compare.py --work /tmp/llmc --only $contender --bases bf16 --batches 4 --mixed-lengths --set $packing --steps 30 --deadline $(( t - 10 )) --json $OUT/widths.jsonl
done
true
