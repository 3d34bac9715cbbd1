"""The table "What ships" of docs/notes/2026-11-24-first-run.md: the down projections of a cached
v4 build (~/.cache/hybridmoe/demo-smollm2-e16k8s768-v4, made by d407732's tree), rounded several
ways, each written as a copy of the build and scored by quality.evaluate. As run (the shipped
plan then carried recipe_version 4; it now says 5 with the same tensors, hence PLAN_VERSION).
`PYTHONPATH=. flock /tmp/hybridmoe-heavy.lock python docs/notes/2026-11-24-first-run-rounding.py
exact delta-q8 delta-q6 delta-q5 delta-q4 d-q8`"""
import json, shutil, sys, tempfile, time
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from hybridmoe.demo import shipped, source, quality
from hybridmoe.demo.spec import DEFAULT_SPEC as spec
torch.set_num_threads(2)
PLAN_VERSION = 5
CACHE = Path.home() / ".cache/hybridmoe/demo-smollm2-e16k8s768-v4"
sd = load_file(str(CACHE / "model.safetensors"))
plan = shipped.load_plan(shipped.plan_path(spec.tag()), spec.as_dict(), PLAN_VERSION)
dense, _ = source.read_dense()
L = len(plan)
def downs_from(sd):
    out = []
    for i, g in enumerate(plan):
        p = f"model.layers.{i}.mlp"
        D = torch.zeros(576, 1536)
        D[:, g["shared"]] = sd[f"{p}.shared_expert.down_proj.weight"] / 2
        for e, ids in enumerate(g["experts"]):
            D[:, ids] = sd[f"{p}.experts.{e}.down_proj.weight"]
        out.append(D)
    return out
def starts():
    out = []
    for i, g in enumerate(plan):
        s = dense[f"model.layers.{i}.mlp.down_proj.weight"].clone()
        s[:, g["experts"].flatten()] *= spec.top_k
        out.append(s)
    return out
Ds, Ss = downs_from(sd), starts()
rel = [float((d - s).norm() / d.norm()) for d, s in zip(Ds, Ss)]
print("delta/D norm per layer", [round(r, 3) for r in rel])
def qblock(x, bits, block=32):
    r, c = x.shape
    xb = x.reshape(r, c // block, block)
    qmax = 2 ** (bits - 1) - 1
    scale = (xb.abs().amax(-1, keepdim=True) / qmax).half().float()
    q = torch.where(scale > 0, (xb / scale).round().clamp(-qmax, qmax), torch.zeros_like(xb))
    return (q * scale).reshape(r, c)
def write_variant(name, newD):
    out = Path(tempfile.gettempdir()) / f"demo-var-{name}"
    if out.exists(): shutil.rmtree(out)
    shutil.copytree(CACHE, out)
    new = dict(sd)
    for i, (g, D) in enumerate(zip(plan, newD)):
        p = f"model.layers.{i}.mlp"
        new[f"{p}.shared_expert.down_proj.weight"] = (2 * D[:, g["shared"]]).contiguous()
        for e, ids in enumerate(g["experts"]):
            new[f"{p}.experts.{e}.down_proj.weight"] = D[:, ids].contiguous()
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
variants = {
  "exact": lambda: Ds,
  "d-bf16": lambda: [D.bfloat16().float() for D in Ds],
  "delta-q8": lambda: [S + qblock(D - S, 8) for D, S in zip(Ds, Ss)],
  "delta-q4": lambda: [S + qblock(D - S, 4) for D, S in zip(Ds, Ss)],
  "delta-q6": lambda: [S + qblock(D - S, 6) for D, S in zip(Ds, Ss)],
  "delta-q5": lambda: [S + qblock(D - S, 5) for D, S in zip(Ds, Ss)],
  "d-q8": lambda: [qblock(D, 8) for D in Ds],
}
for name in sys.argv[1:]:
    newD = variants[name]()
    err = sum(float((a - b).norm() ** 2) for a, b in zip(newD, Ds)) ** 0.5 / sum(float(d.norm() ** 2) for d in Ds) ** 0.5
    t = time.time()
    r = quality.evaluate(write_variant(name, newD))
    print(json.dumps({"variant": name, "rel_err_D": err, "ppl_ratio": r["ppl_ratio"], "moe_ppl": r["moe_ppl"], "dense_ppl": r["dense_ppl"], "top1": r["top1_agreement"], "active": r["active_fraction"], "answer": r["answer"], "eval_s": time.time() - t}), flush=True)
    shutil.rmtree(Path(tempfile.gettempdir()) / f"demo-var-{name}")
