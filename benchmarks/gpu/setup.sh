# sourced by every call: its time budget (BUDGET seconds from now, 570 by default: END for the checks to cut their
# rows to), the wheels, the project on the path, the versions
set -o pipefail
START=$(date +%s)
export END=$(( START + ${BUDGET:-570} ))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-lite/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.whl-bnb:$PWD:$PYTHONPATH
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git log -1 --format='tree %h' 2>/dev/null || true
python3 -c "import torch, transformers, diffusers, peft, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
