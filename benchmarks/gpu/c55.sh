# issue 28: the relaunch with the first step's forward convolutions and cuDNN attention recorded too, replayed at
# launch on a thread that later captures the CUDA graphs, the FLOP count kept in the record, the libraries' one
# read of the installed packages (the working tree), against the committed tree (`git archive HEAD`, the backward
# convolutions alone), alternating. Which attention kernel torch picks for SDXL's shapes comes first.
echo "== c55: the relaunch with the forward's choices made ahead"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
python3 - <<'PY'
import torch
from torch.nn.attention import SDPBackend
for s_q, s_k in ((4096, 4096), (4096, 77), (1024, 1024), (1024, 77)):
    q = torch.zeros(2, 10, s_q, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(2, 10, s_k, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print("sdpa", s_q, s_k, SDPBackend(torch._fused_sdp_choice(q, k, k)).name)
PY
rm -rf /tmp/old && mkdir -p /tmp/old && git archive HEAD | tar -x -C /tmp/old && git log -1 --format='old tree %h'
RUN="python3 $PWD/benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 30 --warmup 10 --set preview.after=false --batch 2"
keep() { cp /tmp/e2e/runs/defaults-b2/train.log $OUT/$1.train.log 2>/dev/null; }
records() { python3 -c "
import glob, json, collections
for p in sorted(glob.glob('/tmp/e2e/runs/.cache/conv-search/*.json')):
    r = json.load(open(p)); c = collections.Counter((x.get('op', 'convolution_backward'), x.get('backward', True)) for x in r['calls'])
    print(p.rsplit('/', 1)[1], 'v', r['version'], len(r['calls']), 'calls', dict(c), 'flops', r.get('flops_per_image'))"; }
t=$(( END - $(date +%s) )); timeout $t $RUN --json $OUT/new.jsonl | grep -v '^\$'; keep new-fresh
t=$(( END - $(date +%s) )); (cd /tmp/old && timeout $t $RUN --json $OUT/old.jsonl | grep -v '^\$'); keep old-fresh
records
for turn in 1 2; do
  for way in new old; do
    t=$(( END - $(date +%s) )); [ $t -ge 50 ] || break 2
    echo "-- relaunch $turn: $way"
    if [ $way = new ]; then timeout $t $RUN --json $OUT/new.jsonl | grep -v '^\$'; else (cd /tmp/old && timeout $t $RUN --json $OUT/old.jsonl | grep -v '^\$'); fi
    keep $way-$turn; grep -h "cuDNN\|warmed up" /tmp/e2e/runs/defaults-b2/train.log | cut -c1-200
  done
done
t=$(( END - $(date +%s) ))
[ $t -ge 60 ] && { echo "-- new, profiled"; timeout $t $RUN --profile --json $OUT/new-prof.jsonl | grep -v '^\$'; keep new-prof; cp /tmp/e2e/runs/*.prof.txt /tmp/e2e/runs/*.prof $OUT/ 2>/dev/null; }
true
