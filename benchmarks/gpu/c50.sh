# issue 28: where a warm relaunch's read of the model goes, and the UNet read on a thread of its own beside the
# pipeline's imports and the other components (sdxl/model.py: UNetReader). Byte-code present, as a user's pip
# install has it (the image sets PYTHONDONTWRITEBYTECODE and installs without byte-code; c33 measured 4-5 s of
# source compilation in each launch). The stack's import timed by module (-X importtime); read_overlap.py (the
# read alone: serial, then on a thread, fresh processes); load_time.py --parts; then the default batch-2 run fresh,
# relaunched, relaunched with the read before the change (sdxl/model.py of 54cbd5d, swapped in for that run only), and relaunched again with the change.
echo "== c50: a warm relaunch's read, byte-code present; the UNet read beside the rest"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
M="import sdxl_lora.training, sdxl_lora.core.loop, sdxl_lora.sdxl.task, accelerate, peft; from diffusers import StableDiffusionXLPipeline"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import train_e2e as t; t.build_model(Path('/tmp/e2e/sdxl-random'), tiny=False)"
echo "built $(( $(date +%s) - START )) s"
for i in 1 2; do /usr/bin/time -f "stack import $i: %e s" python3 -c "$M"; done
python3 -X importtime -c "$M" 2> $OUT/importtime.txt
sort -t'|' -k2 -n -r $OUT/importtime.txt | head -20
for way in serial thread serial thread; do python3 benchmarks/read_overlap.py /tmp/e2e/sdxl-random --way $way 2>/dev/null; done
python3 benchmarks/load_time.py /tmp/e2e/sdxl-random bf16 --unet-device cuda --encoders-as-stored --parts 2>/dev/null
RUN="python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --steps 30 --warmup 10 --set preview.after=false --json $OUT/runs.jsonl"
t=$(( END - $(date +%s) ))
if [ $t -ge 200 ]; then
  timeout $t $RUN --again | grep -v '^\$'
  for d in /tmp/e2e/runs/defaults-b2*/; do cp $d/train.log $OUT/$(basename $d).train.log; done
fi
t=$(( END - $(date +%s) ))
if [ $t -ge 70 ]; then
  echo "-- relaunched, the read before the change"
  cp sdxl_lora/sdxl/model.py /tmp/model_new.py && git show 54cbd5d:sdxl_lora/sdxl/model.py > sdxl_lora/sdxl/model.py
  timeout $t $RUN | grep -v '^\$'
  cp /tmp/model_new.py sdxl_lora/sdxl/model.py
  cp /tmp/e2e/runs/defaults-b2/train.log $OUT/serial.train.log
fi
t=$(( END - $(date +%s) ))
if [ $t -ge 70 ]; then
  echo "-- relaunched, the read beside the rest"
  timeout $t $RUN | grep -v '^\$'
  cp /tmp/e2e/runs/defaults-b2/train.log $OUT/thread.train.log
fi
true
