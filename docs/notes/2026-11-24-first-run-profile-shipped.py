"""Stage timings of a demo build that applies the shipped fit (build() copied with timers):
docs/notes/2026-11-24-first-run.md. `PYTHONPATH=. flock /tmp/hybridmoe-heavy.lock python
docs/notes/2026-11-24-first-run-profile-shipped.py`."""
import time, json, tempfile, shutil
t0 = time.time()
from pathlib import Path
import torch
from hybridmoe.demo import build as B, downs, source
from hybridmoe.demo.spec import DEFAULT_SPEC as spec
from safetensors.torch import save_file
T = {"import": time.time() - t0}
def tick(name, t):
    T[name] = T.get(name, 0) + time.time() - t
    return time.time()
t = time.time()
dense, config = source.read_dense(); t = tick("read_dense (GGUF dequantised)", t)
d = source.digest(); t = tick("sha256 of the GGUF", t)
plans = downs.shipped_plans(dense, spec, 30, B.RECIPE_VERSION, d); t = tick("load + verify + apply shipped downs", t)
tmp = Path(tempfile.mkdtemp())
B.moe_config(config, spec).save_pretrained(str(tmp)); t = tick("config (imports transformers)", t)
sd = B.moe_state_dict(dense, plans, spec); t = tick("moe_state_dict", t)
save_file(sd, str(tmp / B.WEIGHTS), metadata={"format": "pt"}); t = tick("save 540 MB safetensors", t)
B.write_tokenizer(tmp); t = tick("write_tokenizer (from the GGUF)", t)
T["total"] = time.time() - t0
print(json.dumps({k: round(v, 2) for k, v in T.items()}, indent=1))
shutil.rmtree(tmp)
