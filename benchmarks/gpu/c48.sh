# issue 28: the warm relaunch's first step is mostly cuDNN's algorithm search (one per convolution shape, torch
# cannot keep its choices across processes). torch.backends.cudnn.benchmark_limit caps how many algorithms the search
# times for each convolution (torch's default 10). One process a value, the trainer's step with CUDA graphs at batch
# 2 (1024x1024): the first step's time (search and capture), the steady ms/step (the choices' quality) and the
# reserved peak (their workspaces).
echo "== c48: cuDNN's search capped"
for n in 10 1 3; do
  t=$(( END - $(date +%s) )); [ $t -lt 60 ] && { echo "(limit $n: no time left)"; break; }
  timeout $t python3 benchmarks/sdxl_step.py --only ours+graphs --batches 2 --steps 20 --warmup 5 --cudnn-limit $n 2>&1 | grep -v Warning | tail -3
done
true
