"""Per-token overhead of constrained decoding on the demo model's vocabulary (SmolLM2, 49152):
llguidance vs outlines-core, one JSON schema, the tokens of one valid answer."""
import json, time, statistics, sys, os
sys.path.insert(0, os.getcwd())
import numpy as np, torch
from transformers import AutoTokenizer
from hybridmoe.demo.source import tokenizer_dir
hf = AutoTokenizer.from_pretrained(tokenizer_dir())
V = 49152
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
answer = json.dumps({"name": "Ada Lovelace of London", "age": 36, "tags": ["math", "engine", "poetry"], "ok": True}, separators=(",", ":"))
ids = hf.encode(answer, add_special_tokens=False)
logits = torch.randn(V)
out = {}
# llguidance
import llguidance, llguidance.hf
t0 = time.perf_counter(); ll = llguidance.hf.from_tokenizer(hf, n_vocab=V); setup = time.perf_counter() - t0
s2 = dict(schema); s2["x-guidance"] = {"whitespace_flexible": False}
g = llguidance.grammar_from("json_schema", json.dumps(s2))
times = []
for _ in range(5):
    t0 = time.perf_counter(); m = llguidance.LLMatcher(ll, g); compile_s = time.perf_counter() - t0
    per = []
    for t in ids:
        t1 = time.perf_counter()
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:V].astype(bool)
        masked = logits.masked_fill(~torch.from_numpy(bits), -float("inf"))
        assert bits[t], "llguidance refused a valid token"
        m.consume_token(t)
        per.append(time.perf_counter() - t1)
    times.append(statistics.median(per))
out["llguidance"] = {"tokenizer_s": setup, "grammar_s": compile_s, "per_token_ms": 1e3 * statistics.median(times)}
# outlines-core
sys.path.insert(0, "/tmp/oc")
import outlines_core
t0 = time.perf_counter()
vocab = outlines_core.Vocabulary.from_pretrained if False else None
# build a Vocabulary from the HF tokenizer: token string -> ids, as outlines does for byte-level BPE
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return dict(zip(bs, map(chr, cs)))
b2u = {v: k for k, v in bytes_to_unicode().items()}
eos = hf.eos_token_id
mapping = {}
for tok, i in hf.get_vocab().items():
    if i == eos or i >= V: continue
    try: b = bytes(b2u[c] for c in tok)
    except KeyError: continue
    mapping.setdefault(b, []).append(i)
vocab = outlines_core.Vocabulary(eos, mapping)
setup = time.perf_counter() - t0
regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
t0 = time.perf_counter(); index = outlines_core.Index(regex, vocab); compile_s = time.perf_counter() - t0
times = []
for _ in range(5):
    guide = outlines_core.Guide(index)
    per = []
    for t in ids:
        t1 = time.perf_counter()
        allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
        mask = torch.full((V,), True); mask[allowed] = False
        masked = logits.masked_fill(mask, -float("inf"))
        assert not mask[t], "outlines-core refused a valid token"
        guide.advance(t)
        per.append(time.perf_counter() - t1)
    times.append(statistics.median(per))
out["outlines-core"] = {"tokenizer_s": setup, "grammar_s": compile_s, "per_token_ms": 1e3 * statistics.median(times)}
print(json.dumps(out, indent=1), len(ids), "tokens")
