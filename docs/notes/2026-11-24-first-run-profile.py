"""Stage timings of a demo build that fits (build() and fit_model() of recipe v4 copied with
timers): docs/notes/2026-11-24-first-run.md. Run from the repository root:
`PYTHONPATH=. flock /tmp/hybridmoe-heavy.lock python docs/notes/2026-11-24-first-run-profile.py`."""
import os, sys, time, json, tempfile
from pathlib import Path
from collections import defaultdict
t0 = time.time()
import torch
from hybridmoe.demo import build as B, fit as Fm, stream, shipped, source
from hybridmoe.demo.spec import DEFAULT_SPEC, LayerMoE
from hybridmoe.demo.router import neuron_weights
from hybridmoe.demo.split import activations
T = defaultdict(float)
T["import torch+hybridmoe.demo"] = time.time() - t0
def tick(name, t):
    T[name] += time.time() - t
    return time.time()
spec = DEFAULT_SPEC
t = time.time()
dense, config = source.read_dense(); t = tick("read_dense (GGUF dequant)", t)
model = stream.dense_model(dense, config); t = tick("dense_model", t)
calib = Fm.corpus("calibration"); given = shipped.load_plan(shipped.plan_path(spec.tag()), spec.as_dict(), Fm.RECIPE_VERSION); t = tick("corpus+plan load", t)
rows = Fm._rows_for(calib.mask, Fm.CALIBRATION_TOKENS)
batches = [stream.real_tokens(calib.ids[s:s+16], calib.mask[s:s+16]) for s in range(0, rows, 16)]
inputs = [stream.embed(model, seqs) for seqs in batches]
dense_h = [h for h, _, _ in inputs]; moe_h = [h.clone() for h in dense_h]; t = tick("embed", t)
plans = []
with torch.no_grad():
  for i, layer in enumerate(model.layers):
    p = f"model.layers.{i}.mlp"
    gate, up, down = (dense[f"{p}.{n}_proj.weight"] for n in ("gate", "up", "down"))
    halves, xs, targets = [], [], []
    for b, (_, cos_sin, seq_lens) in enumerate(inputs):
        resid_d, x_d = stream.attention_half(layer, dense_h[b], cos_sin, seq_lens); t = tick("attention (dense stream)", t)
        dense_h[b] = resid_d + layer.mlp(x_d); t = tick("dense FFN", t)
        resid_m, x_m = stream.attention_half(layer, moe_h[b], cos_sin, seq_lens); t = tick("attention (moe stream)", t)
        halves.append((resid_m, x_m)); xs.append(x_m); targets.append(dense_h[b] - resid_m)
    x, target = torch.cat(xs), torch.cat(targets); t = tick("cat", t)
    g = given[i]
    h = activations(x, gate, up); t = tick("activations (gate/up)", t)
    start = down.clone(); start[:, g["experts"].flatten()] *= spec.top_k
    z = h * neuron_weights(x, g["shared"], g["experts"], g["router"], spec.top_k, spec.ffn); t = tick("neuron_weights", t)
    gram = z.T @ z; t = tick("gram z.T@z", t)
    lam = Fm.RIDGE * gram.diagonal().mean(); a = gram + lam * torch.eye(gram.shape[0])
    rhs = z.T @ target + lam * start.T; t = tick("rhs z.T@y", t)
    D = torch.linalg.solve(a, rhs).T; t = tick("solve", t)
    out = z @ D.T; t = tick("output z@D.T", t)
    plans.append(LayerMoE(g["shared"], g["experts"], g["router"], D))
    moe_h = [r + o for (r, _), o in zip(halves, out.split([len(r) for r, _ in halves]))]
tmp = Path(tempfile.mkdtemp())
sd = B.moe_state_dict(dense, plans, spec); t = tick("moe_state_dict", t)
B.moe_config(config, spec).save_pretrained(str(tmp)); t = tick("config", t)
from safetensors.torch import save_file
save_file(sd, str(tmp / B.WEIGHTS), metadata={"format": "pt"}); t = tick("save_file 540MB", t)
B.write_tokenizer(tmp); t = tick("write_tokenizer (GGUF vocab)", t)
T["TOTAL"] = time.time() - t0
T["tokens"] = sum(len(h) for h in dense_h)
print(json.dumps(T, indent=1))
import shutil; shutil.rmtree(tmp)
