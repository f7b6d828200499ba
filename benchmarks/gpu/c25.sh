# issue 28: is the GPU machine's 16-17 s import missing byte-code? (about a minute)
echo "== c25: imports"
python3 - <<'PY'
import importlib.util, os, sys
print("dont_write_bytecode", sys.dont_write_bytecode, "env", os.environ.get("PYTHONDONTWRITEBYTECODE"), "prefix", sys.pycache_prefix)
for name in ["torch", "transformers", "diffusers", "peft", "accelerate", "safetensors", "numpy", "PIL", "sympy", "triton", "bitsandbytes", "pydantic", "sdxl_lora"]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        print(name, "not found"); continue
    d = os.path.dirname(spec.origin)
    pc = os.path.join(d, "__pycache__")
    n = len(os.listdir(pc)) if os.path.isdir(pc) else 0
    print(f"{name:13s} {'writable' if os.access(d, os.W_OK) else 'read-only':9s} pycache files {n:4d}  {d}")
PY
M="import sdxl_lora.core.loop, sdxl_lora.sdxl.task, diffusers, transformers, peft, accelerate"
TIMEFORMAT="%R s"
echo "-- python -c pass"; time python3 -c pass
echo "-- import torch (plain)"; time python3 -c "import torch"
for i in 1 2; do echo "-- stack plain $i"; time python3 -c "$M"; done
rm -rf /tmp/pyc
for i in 1 2; do echo "-- stack PYTHONPYCACHEPREFIX=/tmp/pyc $i"; time PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "$M"; done
echo "-- after prefix, plain again"; time python3 -c "$M"
PYTHONPYCACHEPREFIX=/tmp/pyc python3 -X importtime -c "$M" 2> $OUT/importtime.txt
sort -t'|' -k2 -n -r $OUT/importtime.txt | head -25
