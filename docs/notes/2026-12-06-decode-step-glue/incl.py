"""Inclusive time per call of chosen functions at decode, without a profiler (wrapper ~0.3 us).
Usage: PYTHONPATH=. python incl.py MODEL.gguf THREADS."""
import sys, time, torch, collections, importlib
from hybridmoe.cli.options import compute_dtype
from hybridmoe.engine.generate import GenerationStats, generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(modname, qual):
    mod = importlib.import_module(modname); obj = mod; parts = qual.split(".")
    for p in parts[:-1]: obj = getattr(obj, p)
    f = getattr(obj, parts[-1]); key = qual
    def g(*a, **k):
        t = time.perf_counter_ns()
        try: return f(*a, **k)
        finally: acc[key] += time.perf_counter_ns() - t; cnt[key] += 1
    setattr(obj, parts[-1], g)
    if len(parts) == 1:  # module-level function: patch importers too
        for m in list(sys.modules.values()):
            if m is not None and getattr(m, parts[-1], None) is f: setattr(m, parts[-1], g)
for modname, qual in [
    ("hybridmoe.engine.llm_engine", "LLMEngine.step"), ("hybridmoe.engine.llm_engine", "LLMEngine._pass"),
    ("hybridmoe.engine.llm_engine", "LLMEngine._postprocess"), ("hybridmoe.engine.llm_engine", "LLMEngine._next_token"),
    ("hybridmoe.engine.scheduler", "Scheduler.schedule"),
    ("hybridmoe.engine.model_runner", "ModelRunner.run"), ("hybridmoe.engine.model_runner", "ModelRunner._inputs"),
    ("hybridmoe.engine.model_runner", "ModelRunner._run"),
    ("hybridmoe.models.base", "CausalLM.forward"), ("hybridmoe.models.base", "CausalLM.logits"),
    ("hybridmoe.layers.embedding", "Embedding.forward"), ("hybridmoe.layers.rotary", "Rotary.cos_sin"),
    ("hybridmoe.layers.decoder", "DecoderLayer.forward"), ("hybridmoe.layers.attention", "Attention.decoder_half"),
    ("hybridmoe.layers.attention", "Attention._block_table"), ("hybridmoe.layers.moe", "SparseMoE.forward"),
    ("hybridmoe.layers.moe", "SparseMoE.route"), ("hybridmoe.layers.moe", "SparseMoE.decoder_half"), ("hybridmoe.layers.moe", "SparseMoE.choose"), ("hybridmoe.layers.moe", "SparseMoE._token_path"),
    ("hybridmoe.experts.run.runtime", "BaseRuntime.ran_token"), ("hybridmoe.experts.run.runtime_stats", "RuntimeStats.on_layer"), ("hybridmoe.layers.moe", "softmax_topk"), ("hybridmoe.experts.run.runtime", "BaseRuntime.forward"),
    ("hybridmoe.experts.run.runtime", "BaseRuntime.begin_step"), ("hybridmoe.layers.norm", "RMSNorm.forward"),
    ("hybridmoe.engine.sampler", "sample"), ("hybridmoe.layers.embedding", "Embedding.forward"), ("hybridmoe.engine.llm_engine", "LLMEngine._mark_scheduled"), ("hybridmoe.engine.llm_engine", "LLMEngine._account"), ("hybridmoe.engine.block_manager", "BlockManager.commit"), ("hybridmoe.engine.llm_engine", "LLMEngine._expire"), ("hybridmoe.native.quant", "moe_tokens"), ("hybridmoe.native.bf16", "decoder_attention"),
    ("hybridmoe.native.quant", "linear"), ("hybridmoe.native.bf16", "linear"), ("hybridmoe.engine.paged_kv", "PagedKVContext.__init__"),
]:
    try: wrap(modname, qual)
    except Exception as e: print("skip", qual, e)
path, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
model = load_model(path, dtype=compute_dtype("bf16"), progress=False)
prompt = list(range(5, 517))
def run(n):
    st = GenerationStats()
    list(generate_ids(model, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), stats=st))
    return st
run(8)
for r in range(2):
    acc.clear(); cnt.clear(); run(1); a, ac = dict(acc), dict(cnt); acc.clear(); cnt.clear(); st = run(65)
    print(f"decode {1000*st.decode_s/64:.2f} ms/tok")
    for k in acc:
        t = (acc[k] - a.get(k, 0)) / 1e3 / 64; n = (cnt[k] - ac.get(k, 0)) / 64
        print(f"  {k:<32} {t:8.1f} us/step  {n:4.1f} calls/step")
