"""`hybridmoe export` and `bench make-model --format gguf-*`: files our GGUF loader reads back to
the source model's logits, with the tokenizer, metadata and tensors llama.cpp's loader asks for, and
Q4_K_M's mix of types as llama-quantize picks it. (llama.cpp itself is a benchmark peer, never a
test dependency: docs/notes/2026-11-24-gguf-files.md records it loading and generating from these
files.)"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hybridmoe.cli import main
from hybridmoe.export.gguf_export import export_gguf
from hybridmoe.export.sources import Checkpoint
from hybridmoe.loader import gguf_file, load_model, load_tokenizer
from tests.contiguous_kv import SequenceKV, forward_step
from tests.tiny import TINY_COMMON, build_tiny, hf_logits

Q = gguf.GGMLQuantizationType
IDS = [5, 17, 42, 8, 30, 2, 64, 11, 3, 77, 19, 50, 23, 9, 61, 40]


@pytest.fixture(autouse=True)
def exact_products(monkeypatch):
    """Logits are compared with fp32 references: products with blocks take the exact path
    (dequantise, multiply in fp32); the integer kernels have their own bounds (test_quant.py)."""
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")


def wide_qwen3_moe(out):
    """A 2-layer Qwen3-MoE whose every matrix is 256 wide, so Q4_K_M uses Q4_K and Q6_K (not the
    fallbacks of narrow rows): layer 0 gets Q4_K attn_v and ffn_down_exps, layer 1 Q6_K."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        **{**TINY_COMMON, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # weights large enough that quantisation changes the logits visibly
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(out)
    return model.eval()


def our_logits(path, ids=IDS) -> torch.Tensor:
    """Decode `ids` one at a time through our engine: fp32 logits [len(ids), V]."""
    model, cache = load_model(path, progress=False), SequenceKV()
    return torch.stack([forward_step(model, cache, [t], i) for i, t in enumerate(ids)])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def gguf_types(path) -> dict[str, str]:
    return {t.name: Q(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}


# ---- logits: the file computes the source model (bf16) or its own blocks (q8_0, q4_k_m) ----


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    ref = wide_qwen3_moe(d)
    files = {f: export_gguf(Checkpoint(d), d / f"{f}.gguf", f, progress=False) for f in FORMATS}
    return d, ref, files


FORMATS = ("gguf-bf16", "gguf-q8_0", "gguf-q4_k_m")


def test_bf16_export_computes_the_model_with_bf16_rounded_weights(wide):
    d, ref, files = wide
    with torch.no_grad():  # what BF16 holds: matrices rounded to bf16, norms F32
        for p in ref.parameters():
            if p.dim() >= 2:
                p.copy_(p.bfloat16().float())
    assert rel_err(our_logits(files["gguf-bf16"]), hf_logits(ref, IDS)) <= 1e-4


def dequantised_reference(path, out):
    """transformers' model on the weights gguf-py's own dequantize reads from the file `path`: a
    reference that shares no code with our loader (names mapped back here, experts split)."""
    from transformers import AutoModelForCausalLM

    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per_layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate_inp": "mlp.gate",
    }
    state = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
        parts = t.name.split(".")
        if parts[0] != "blk":
            state[f"{top[parts[0]]}.weight"] = w
        elif parts[2].endswith("_exps"):
            role = parts[2].removeprefix("ffn_").removesuffix("_exps")
            for e, expert in enumerate(w):
                state[f"model.layers.{parts[1]}.mlp.experts.{e}.{role}_proj.weight"] = expert
        else:
            state[f"model.layers.{parts[1]}.{per_layer[parts[2]]}.weight"] = w
    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text((path.parent / "config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("fmt", ["gguf-q8_0", "gguf-q4_k_m"])
def test_quantised_export_computes_its_blocks_and_keeps_the_top_token(wide, fmt, tmp_path):
    d, ref, files = wide
    got = our_logits(files[fmt])
    exact = hf_logits(dequantised_reference(files[fmt], tmp_path / "dequantised"), IDS)
    assert rel_err(got, exact) <= 1e-4
    full = hf_logits(ref, IDS)
    agree = (got.argmax(-1) == full.argmax(-1)).float().mean()
    # measured: 16/16 and 1.3% logit error (q8_0), 15/16 and 17.5% (q4_k_m: our min/max Q4_K
    # rounding of N(0, 0.1) weights; llama.cpp's search would err less); exact part: 5e-7
    assert agree >= {"gguf-q8_0": 0.9, "gguf-q4_k_m": 0.75}[fmt]
    assert rel_err(got, full) <= {"gguf-q8_0": 0.03, "gguf-q4_k_m": 0.25}[fmt]


def test_q4_k_m_mix_is_llama_quantizes(wide):
    """llama-quantize Q4_K_M on a 2-layer model: use_more_bits picks layer 1 (the last eighth), so
    its attn_v and ffn_down_exps are Q6_K; output Q6_K; routers, norms F32; the rest Q4_K."""
    types = gguf_types(wide[2]["gguf-q4_k_m"])
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    for layer, more in ((0, "Q4_K"), (1, "Q6_K")):
        assert types[f"blk.{layer}.attn_v.weight"] == more
        assert types[f"blk.{layer}.ffn_down_exps.weight"] == more
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{layer}.{name}.weight"] == "Q4_K"
        for name in ("ffn_gate_inp", "attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
            assert types[f"blk.{layer}.{name}.weight"] == "F32"
    q8 = gguf_types(wide[2]["gguf-q8_0"])
    assert {q8["output.weight"], q8["blk.0.ffn_down_exps.weight"]} == {"Q8_0"}


def test_narrow_rows_fall_back_as_llama_cpp_does(tmp_path):
    """64-wide rows fill no 256-block: Q4_K -> Q5_0, Q6_K -> Q8_0 (attn_v of the last layer, the
    head), and 48-wide ones no 32-block either: F16. Q5_0 is read back as values."""
    build_tiny("qwen2_moe", tmp_path)
    path = export_gguf(Checkpoint(tmp_path), tmp_path / "m.gguf", "gguf-q4_k_m", progress=False)
    types = gguf_types(path)
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.3.attn_v.weight"] == "Q8_0"
    assert types["output.weight"] == "Q8_0" and types["blk.1.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.1.ffn_down_shexp.weight"] == "F16"  # 48 wide: Q4_K -> Q5_0 -> F16
    assert torch.isfinite(our_logits(path)).all()


# ---- what llama.cpp's loader asks of a file, read back with gguf-py ----

# per llama.cpp architecture: keys its hparams loader requires, tensors its model loader requires
REQUIRED = {
    "qwen2moe": ("expert_feed_forward_length", "expert_shared_feed_forward_length"),
    "qwen3moe": ("expert_feed_forward_length", "attention.key_length"),
    "llama": ("rope.freq_base",),
    "olmoe": (),
    "deepseek2": ("attention.kv_lora_rank", "rope.dimension_count", "leading_dense_block_count"),
}
COMMON_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
)


@pytest.mark.parametrize(
    "arch,gguf_arch",
    [
        ("qwen2_moe", "qwen2moe"),
        ("qwen3_moe", "qwen3moe"),
        ("mixtral", "llama"),
        ("olmoe", "olmoe"),
        ("deepseek_v3", "deepseek2"),
    ],
)
def test_metadata_and_tensors_are_what_llama_cpp_loads(arch, gguf_arch, tmp_path):
    build_tiny(arch, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    path = export_gguf(Checkpoint(tmp_path), tmp_path / "m.gguf", "gguf-q8_0", progress=False)
    reader = gguf_file.Reader(str(path))
    meta = gguf_file.metadata(path)
    assert meta["general.architecture"] == gguf_arch
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    for key in (*COMMON_KEYS, *REQUIRED[gguf_arch]):
        assert f"{gguf_arch}.{key}" in meta, key
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    assert meta[f"{gguf_arch}.expert_count"] == experts
    dims = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml order: ne0 first
    hidden = cfg["hidden_size"]
    assert dims["token_embd.weight"] == (hidden, cfg["vocab_size"])
    assert dims["output.weight"] == (hidden, cfg["vocab_size"])  # untied or written out
    moe = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    layer = min(int(n.split(".")[1]) for n in dims if n.endswith("ffn_gate_exps.weight"))
    assert dims[f"blk.{layer}.ffn_gate_exps.weight"] == (hidden, moe, experts)
    assert dims[f"blk.{layer}.ffn_down_exps.weight"] == (moe, hidden, experts)
    if gguf_arch == "qwen2moe":  # declared 1-D [n_embd] by llama.cpp
        assert dims[f"blk.{layer}.ffn_gate_inp_shexp.weight"] == (hidden,)


def test_tied_qwen2_moe_head_is_written_out(tmp_path):
    """llama.cpp's qwen2moe refuses a file without output.weight; the demo model ties its head."""
    build_tiny("qwen2_moe", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    path = export_gguf(Checkpoint(tmp_path), tmp_path / "m.gguf", "gguf-bf16", progress=False)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert np.array_equal(tensors["output.weight"].data, tensors["token_embd.weight"].data)


# ---- the tokenizer ----


@pytest.fixture(scope="module")
def chat_gguf(tiny_chat_model, tmp_path_factory):
    """The tiny Mixtral with SmolLM2's 49152-token tokenizer, exported."""
    out = tmp_path_factory.mktemp("chat") / "chat.gguf"
    return export_gguf(Checkpoint(tiny_chat_model), out, "gguf-q8_0", progress=False)


def test_tokenizer_is_what_llama_cpps_converter_wrote_for_smollm2(chat_gguf):
    """SmolLM2's own GGUF (llama.cpp's converter wrote it) is the reference: the same tokens, types,
    merges and special ids. The pre-tokenizer differs on purpose: the HF tokenizer we export
    (transformers' reading of that file) splits like GPT-2, without SmolLM2's single digits."""
    from tests.conftest import smollm2_gguf

    ours = gguf_file.Reader(str(chat_gguf)).fields
    theirs = gguf_file.Reader(str(smollm2_gguf())).fields
    for key in ("tokens", "token_type", "merges"):
        assert (
            ours[f"tokenizer.ggml.{key}"].contents() == theirs[f"tokenizer.ggml.{key}"].contents()
        )
    for key in ("model", "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        assert (
            ours[f"tokenizer.ggml.{key}"].contents() == theirs[f"tokenizer.ggml.{key}"].contents()
        )
    assert ours["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert "im_start" in ours["tokenizer.chat_template"].contents()


def test_tokenizer_round_trips_through_our_gguf_loader(chat_gguf, tiny_chat_model):
    from hybridmoe.loader.tokenizer import load_tokenizer_dir

    text = "The year 2024: 3.14 apples, naïve café — ünïcödé!\n\tIndented <|im_end|> 你好"
    hf, ours = load_tokenizer_dir(tiny_chat_model), load_tokenizer(chat_gguf)
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.encode_chat(chat) == hf.encode_chat(chat)


# ---- the commands ----


@pytest.mark.parametrize("fmt", ["gguf-q4_k_m", "hf"])
def test_make_model_writes_a_loadable_model_with_a_tokenizer(fmt, tmp_path, capsys):
    out = tmp_path / ("m" if fmt == "hf" else "m.gguf")
    args = ["bench", "make-model", "--shape", "tiny", "--layers", "1", "--format", fmt]
    assert main([*args, "--out", str(out)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # nothing temporary left
    tok = load_tokenizer(out)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world" and max(ids) < 256
    assert torch.isfinite(our_logits(out, ids)).all()


def test_make_model_gguf_formats_hold_one_model(tmp_path):
    """The same seed gives the same values in every GGUF format: BF16 holds them rounded, Q8_0
    holds them quantised (within Q8_0's error of the BF16 file)."""
    files = {}
    for fmt in ("gguf-bf16", "gguf-q8_0"):
        files[fmt] = tmp_path / f"{fmt}.gguf"
        args = ["bench", "make-model", "--shape", "tiny", "--layers", "1", "--format", fmt]
        assert main([*args, "--out", str(files[fmt])]) == 0
    read = {
        fmt: {t.name: t for t in gguf.GGUFReader(str(path)).tensors} for fmt, path in files.items()
    }
    name = "blk.0.ffn_up_exps.weight"
    bf16 = gguf.quants.dequantize(read["gguf-bf16"][name].data, Q.BF16)
    q8 = gguf.quants.dequantize(read["gguf-q8_0"][name].data, Q.Q8_0)
    assert np.abs(q8 - bf16).max() <= 0.01 * np.abs(bf16).max()
    assert read["gguf-q8_0"][name].tensor_type == Q.Q8_0


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def test_export_bad_input_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    out = str(tmp_path / "x.gguf")
    cases = {
        "no such directory": ("export", "--model", str(tmp_path / "none"), "--format", "gguf-q8_0"),
        "a file": ("export", "--model", __file__, "--format", "gguf-q8_0"),
        "no config.json": ("export", "--model", str(model), "--format", "gguf-q8_0"),
    }
    for what, args in cases.items():
        code, err = run_cli(capsys, *args, "--out", out)
        (line,) = [row for row in err.splitlines() if "error" in row]
        assert code == 2 and what in line, (what, err)
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": []}))
    (model / "model.safetensors").write_bytes(b"")
    save_file({"x": torch.zeros(1)}, str(model / "model.safetensors"))
    code, err = run_cli(
        capsys, "export", "--model", str(model), "--format", "gguf-bf16", "--out", out
    )
    assert code == 2 and "'gpt2'" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [model]  # no file, no temporary left


def test_export_with_an_unknown_pre_tokenizer_leaves_nothing(tiny_chat_model, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "x.gguf"
    code, err = run_cli(
        capsys, "export", "--model", str(model), "--format", "gguf-bf16", "--out", str(out)
    )
    assert code == 2 and "--no-tokenizer" in err and "Whitespace" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    args = ("export", "--model", str(model), "--format", "gguf-bf16", "--no-tokenizer")
    assert run_cli(capsys, *args, "--out", str(out))[0] == 0 and out.exists()


def test_smollm_pre_tokenizer_splits_digits_one_by_one_as_llama_cpp():
    """SmolLM2's own GGUF names the "smollm" pre-tokenizer: llama.cpp splits every digit apart
    before GPT-2's regex (transformers' GGUF reader alone would merge "2024" into fewer tokens)."""
    from tests.conftest import smollm2_gguf

    tok = load_tokenizer(smollm2_gguf())
    ids = tok.encode("In 2024, 3.14159 apples", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("2024314159")
    assert tok.decode(ids) == "In 2024, 3.14159 apples"


def test_zero_shared_expert_gate_is_written_so_llama_cpp_has_no_nan(tmp_path):
    """llama.cpp computes the qwen2moe shared-expert gate's sigmoid(x) as silu(x)/x (NaN at 0); the
    demo model's gate is all zeros (sigmoid 1/2). The file holds 2**-24 instead, and still computes
    the model: logits within 1e-4 of transformers' with the zero gate (weights rounded to bf16)."""
    from safetensors.torch import load_file

    from hybridmoe.export.gguf_layout import TINY_GATE

    ref = build_tiny("qwen2_moe", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.zero_()
            if p.dim() >= 2:
                p.copy_(p.bfloat16().float())
    for name in state:
        if name.endswith("shared_expert_gate.weight"):
            state[name] = torch.zeros_like(state[name])
    save_file(state, str(tmp_path / "model.safetensors"))
    path = export_gguf(Checkpoint(tmp_path), tmp_path / "m.gguf", "gguf-bf16", progress=False)
    gates = [t for t in gguf.GGUFReader(str(path)).tensors if "ffn_gate_inp_shexp" in t.name]
    assert gates and all(np.all(np.asarray(t.data) == TINY_GATE) for t in gates)
    assert rel_err(our_logits(path), hf_logits(ref, IDS)) <= 1e-4
