# issue 28: the stack's import with byte-code written once and read after (the image sets PYTHONDONTWRITEBYTECODE=1,
# which c25's runs with PYTHONPYCACHEPREFIX kept: they never wrote any), then a batch-4 cold launch and warm
# relaunch through the CLI with byte-code, as a machine whose packages hold it runs them
echo "== c33: imports with byte-code, b4 cold and warm with it"
M="import sdxl_lora.core.loop, sdxl_lora.sdxl.task, diffusers, transformers, peft, accelerate"
TIMEFORMAT="%R s"
echo "-- stack plain"; time python3 -c "$M"
rm -rf /tmp/pyc
for i in 1 2 3; do echo "-- stack, byte-code in /tmp/pyc, $i"; time env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "$M"; done
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
python3 -c "import sys; print('dont_write_bytecode', sys.dont_write_bytecode, 'prefix', sys.pycache_prefix)"
timeout $(( END - $(date +%s) - 5 )) python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 4 --steps 30 --warmup 6 --run-steps 300 --again --json $OUT/b4bc.jsonl
mkdir -p $OUT/c33 && cp /tmp/e2e/runs/*.log $OUT/c33/ 2>/dev/null
true
