"""GGUF loading: every tiny architecture written in llama.cpp's layout loads to transformers'
logits; quantized blocks dequantize as the format spec says; the real SmolLM2 Q4_1 file matches
transformers."""

import json

import gguf
import numpy as np
import pytest
import torch

from hybridmoe.config import HFConfig
from hybridmoe.loader import gguf_file, load_model, model_config
from hybridmoe.quant.tensor import QTensor
from tests.conftest import smollm2_gguf
from tests.console import hybridmoe
from tests.contiguous_kv import SequenceKV, forward_step
from tests.gguf_writer import GGUF_ARCH, Q, permute_rows, write_gguf
from tests.tiny import BUILDERS, build_tiny, hf_logits


@pytest.fixture(autouse=True)
def exact_products(monkeypatch):
    """These tests check the loader (names, layouts, blocks kept as stored) against transformers to
    1e-4, so products with blocks take the exact path (dequantise, multiply in fp32); the integer
    kernels quantise activations to int8 and are checked against their own bound in
    test_quant.py."""
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")


ARCHS = sorted(a for a in BUILDERS if a in GGUF_ARCH)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tiny_reference(arch: str, out):
    """A tiny transformers model saved in `out`. DeepSeek: GGUF has one yarn mscale, so mscale is
    set to mscale_all_dim (as in the real V2/V3 configs) and the reference reloaded with it."""
    ref = build_tiny(arch, out)
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("mscale_all_dim") is not None and rope.get("mscale") != rope["mscale_all_dim"]:
        from transformers import AutoModelForCausalLM

        rope["mscale"] = rope["mscale_all_dim"]
        (out / "config.json").write_text(json.dumps(cfg))
        ref = AutoModelForCausalLM.from_pretrained(out).float().eval()
    return ref


def round_through_f16(model) -> None:
    """What an F16 GGUF holds: matrices rounded to fp16, norms and biases (1-D) kept in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())


def our_logits(model, ids: list[int]) -> torch.Tensor:
    """Prefill half the ids, decode the rest one by one: fp32 logits [n - n//2, V] of the decode
    steps."""
    cache, half = SequenceKV(), len(ids) // 2
    forward_step(model, cache, ids[:half], 0)
    return torch.stack([forward_step(model, cache, [ids[i]], i) for i in range(half, len(ids))])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=["F32", "F16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_logits_match_transformers(arch, qtype, tmp_path):
    ref = tiny_reference(arch, tmp_path)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", qtype)
    if qtype == Q.F16:
        round_through_f16(ref)
    ours = load_model(path, progress=False)
    ids = torch.randint(
        0, ref.config.vocab_size, (16,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    want = hf_logits(ref, ids)[8:]  # [8, V]
    got = our_logits(ours, ids)
    assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_bf16_gguf_logits_match_transformers_with_bf16_weights(arch, tmp_path):
    ref = tiny_reference(arch, tmp_path)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", Q.BF16)
    with torch.no_grad():  # what a BF16 GGUF holds: matrices rounded to bf16, 1-D tensors fp32
        for p in ref.parameters():
            if p.dim() >= 2:
                p.copy_(p.bfloat16().float())
    ids = list(range(7, 23))
    got = our_logits(load_model(path, progress=False), ids)
    assert rel_err(got, hf_logits(ref, ids)[8:]) <= 1e-4


def test_legacy_per_expert_mixtral_gguf_loads(tmp_path):
    ref = tiny_reference("mixtral", tmp_path)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", legacy_experts=True)
    assert any(t.name == "blk.0.ffn_up.7.weight" for t in gguf.GGUFReader(str(path)).tensors)
    ids = list(range(4, 20))
    assert (
        rel_err(our_logits(load_model(path, progress=False), ids), hf_logits(ref, ids)[8:]) <= 1e-4
    )


def test_count_tensors_is_what_iter_tensors_yields(tmp_path):
    tiny_reference(
        "deepseek_v3", tmp_path
    )  # stacked experts and split kv_b: counts differ from the file's
    path = write_gguf(tmp_path, tmp_path / "model.gguf")
    yielded = list(gguf_file.iter_tensors(path, model_config(path)))
    assert gguf_file.count_tensors(path) == len(yielded) != len(gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_config_matches_config_json(arch, tmp_path):
    tiny_reference(arch, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    ours = model_config(write_gguf(tmp_path, tmp_path / "model.gguf")).data
    keys = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "n_shared_experts",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "shared_expert_intermediate_size",
        "clip_qkv",
    ]
    if not arch.startswith("deepseek"):  # MLA is stored as MQA: one KV head in the file
        keys.append("num_key_value_heads")
    for key in keys:
        if hf.get(key) is not None:
            assert ours.get(key) == pytest.approx(hf[key]), key
    assert expert_count(ours) == expert_count(hf)
    assert ours["architectures"] == hf["architectures"]
    assert bool(ours["tie_word_embeddings"]) == bool(hf.get("tie_word_embeddings"))
    assert ours["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"], rel=1e-6)


def expert_count(cfg: dict):
    """Architectures name it differently (and transformers writes aliases); any one will do."""
    return next(
        (cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k)),
        None,
    )


# ---- quantized blocks, against a dequantizer written from the format spec
# (ggml-quants.c layouts) ----


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def ref_dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """raw: [n_blocks, block_bytes] uint8 -> [n_blocks, values] float32."""
    if qtype == Q.Q8_0:  # d:f16, qs:int8[32]; x = d * q
        return _f16(raw[:, :2]) * raw[:, 2:].view(np.int8).astype(np.float32)
    if qtype in (
        Q.Q4_0,
        Q.Q4_1,
    ):  # d:f16, (m:f16), qs:u8[16]; low nibbles are x[0:16], high x[16:32]
        head = 2 if qtype == Q.Q4_0 else 4
        qs = raw[:, head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if qtype == Q.Q4_0:
            return _f16(raw[:, :2]) * (q - 8)
        return _f16(raw[:, :2]) * q + _f16(raw[:, 2:4])
    if qtype == Q.Q4_K:
        return ref_q4_k(raw)
    raise NotImplementedError(qtype)


def ref_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-block (256 values): d, dmin: f16; scales: 12 bytes of 6-bit (scale, min) x 8;
    qs: 128 bytes."""
    d, dmin, sc, qs = (
        _f16(raw[:, 0:2]),
        _f16(raw[:, 2:4]),
        raw[:, 4:16].astype(np.int32),
        raw[:, 16:],
    )
    scale = np.empty((raw.shape[0], 8), np.float32)
    mins = np.empty_like(scale)
    for j in range(8):
        if j < 4:
            scale[:, j], mins[:, j] = sc[:, j] & 63, sc[:, j + 4] & 63
        else:
            scale[:, j] = (sc[:, j + 4] & 0x0F) | ((sc[:, j - 4] >> 6) << 4)
            mins[:, j] = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
    out = []
    for chunk in range(4):  # 64 values each: low nibbles of 32 bytes, then their high nibbles
        q = qs[:, 32 * chunk : 32 * chunk + 32]
        for half, nib in enumerate((q & 0x0F, q >> 4)):
            j = 2 * chunk + half
            out.append(d * scale[:, j : j + 1] * nib.astype(np.float32) - dmin * mins[:, j : j + 1])
    return np.concatenate(out, axis=1)


def raw_blocks(path, t) -> np.ndarray:
    """A tensor's bytes read straight from the file, as [n_blocks, block_bytes]."""
    block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
    with open(path, "rb") as f:
        f.seek(t.data_offset)
        return np.frombuffer(f.read(t.n_bytes), np.uint8).reshape(-1, block_bytes)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_weights_match_spec_dequantizer(qtype, tmp_path):
    tiny_reference("mixtral", tmp_path)  # experts, router, attention: every kind of matrix
    path = write_gguf(tmp_path, tmp_path / "model.gguf", qtype)
    cfg = model_config(path)
    loaded = gguf_file.iter_tensors(path, cfg)
    ours = {name: t.dequantize() if isinstance(t, QTensor) else t for name, t in loaded}
    reader = gguf.GGUFReader(str(path))
    checked = 0
    for t in reader.tensors:
        if t.tensor_type != qtype:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = torch.from_numpy(ref_dequantize(raw_blocks(path, t), qtype).reshape(shape))
        got = _ours_in_gguf_layout(ours, t.name, shape, cfg)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        checked += 1
    assert checked >= 10  # q, k, v, o, router and expert stacks of 2 layers


def _ours_in_gguf_layout(ours: dict, name: str, shape: tuple, cfg) -> torch.Tensor:
    """Our loaded tensor(s) for GGUF tensor `name`, put back into the file's layout."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    if name in top:
        return ours[top[name]]
    _, layer, base, _ = name.split(".")
    if base.endswith("_exps"):
        role = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}[base]
        return torch.stack(
            [
                ours[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{role}.weight"]
                for e in range(shape[0])
            ]
        )
    hf = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate_inp": "block_sparse_moe.gate",
    }[base]
    w = ours[f"model.layers.{layer}.{hf}.weight"]
    if base in ("attn_q", "attn_k"):
        w = permute_rows(
            w, cfg.get("num_attention_heads" if base == "attn_q" else "num_key_value_heads")
        )
    return w


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_model_stays_close_to_full_precision(qtype, tmp_path):
    ref = tiny_reference("llama", tmp_path)
    ours = load_model(write_gguf(tmp_path, tmp_path / "model.gguf", qtype), progress=False)
    ids = list(range(5, 21))
    bound = {Q.Q8_0: 0.02, Q.Q4_0: 0.3, Q.Q4_1: 0.3}[qtype]
    assert rel_err(our_logits(ours, ids), hf_logits(ref, ids)[8:]) <= bound


_K_QUANT_CFG = HFConfig({"model_type": "llama", "num_attention_heads": 1, "num_key_value_heads": 1})


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_blocks_load_in_their_element_shape(qtype, tmp_path):
    """gguf cannot quantize K-quants,
    so random blocks are crafted (sane fp16 scales) and written raw."""
    rows, cols = 6, 512
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    scale_at = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [block_bytes - 2]}[
        qtype
    ]  # where the f16 d/dmin live
    for at in scale_at:
        raw[:, at : at + 2] = (
            rng.uniform(0.001, 0.01, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        )
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw.reshape(rows, -1), raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    (blocks,) = [t for _, t in gguf_file.iter_tensors(path, _K_QUANT_CFG)]
    assert isinstance(blocks, QTensor) and blocks.fmt.ggml == qtype  # kept in its blocks, as stored
    assert torch.equal(blocks.data, torch.from_numpy(raw.reshape(rows, -1)))
    got = blocks.dequantize()
    assert got.shape == (rows, cols) and torch.isfinite(got).all()
    torch.testing.assert_close(
        got, torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1), qtype))
    )
    if qtype == Q.Q4_K:  # and an independent reference for one K-quant
        torch.testing.assert_close(
            got.reshape(-1, 256), torch.from_numpy(ref_q4_k(raw)), rtol=1e-6, atol=1e-6
        )


# ---- the real file: SmolLM2-135M-Instruct Q4_1 (llama arch, tied embeddings) ----


@pytest.fixture(scope="module")
def smollm2():
    from hybridmoe.loader import load_tokenizer

    path = smollm2_gguf()
    return path, load_tokenizer(path), load_model(path, progress=False)


def test_smollm2_logits_match_transformers_gguf_load(smollm2, monkeypatch):
    import functools

    from transformers import LlamaForCausalLM

    # transformers rebuilds gguf's tensor-name map once per tensor (~14 s here) and parses the file
    # through slow memmap slicing; both are pure, so they are sped up: its weights and arithmetic
    # are unchanged
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    monkeypatch.setattr(gguf, "GGUFReader", gguf_file.Reader)
    path, tok, ours = smollm2
    ref = LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = tok.encode("The quick brown fox jumps over the lazy dog because")
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0, -4:].float()  # [4, V]
    got = our_logits(ours, ids)[-4:]
    assert rel_err(got, want) <= 1e-4


def test_smollm2_knows_the_capital_of_france(smollm2):
    from hybridmoe.engine.generate import generate_ids
    from hybridmoe.engine.sampler import SamplingParams

    _, tok, ours = smollm2
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = generate_ids(ours, ids, SamplingParams(max_tokens=8, temperature=0), tok.eos_ids)
    assert "Paris" in tok.decode(list(out))


# ---- damaged files: one line naming the file and the problem ----


@pytest.fixture
def good_gguf(tmp_path):
    tiny_reference("llama", tmp_path)
    return write_gguf(tmp_path, tmp_path / "model.gguf")


def load_error(path) -> str:
    from hybridmoe.errors import ModelFileError

    with pytest.raises(ModelFileError) as info:
        load_model(path, progress=False)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_truncated_tensor_data_is_reported(good_gguf):
    data = good_gguf.read_bytes()
    good_gguf.write_bytes(data[: len(data) - 1000])
    assert "truncated" in load_error(good_gguf)


def test_header_cut_short_is_reported(good_gguf):
    good_gguf.write_bytes(good_gguf.read_bytes()[:100])
    assert "cut short or corrupt" in load_error(good_gguf)


def test_corrupt_header_is_reported(good_gguf):
    data = bytearray(good_gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and metadata counts
    good_gguf.write_bytes(bytes(data))
    assert "corrupt" in load_error(good_gguf)


def test_bad_magic_is_reported(good_gguf):
    good_gguf.write_bytes(b"GGML" + good_gguf.read_bytes()[4:])
    assert "GGUF" in load_error(good_gguf)


def test_missing_tensor_is_reported(tmp_path):
    tiny_reference("mixtral", tmp_path)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", drop="blk.1.attn_v.weight")
    assert "layers.1.self_attn.v_proj" in load_error(path)


def test_unsupported_gguf_architecture_is_reported(tmp_path):
    tiny_reference("llama", tmp_path)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", arch_name="gpt2")
    assert "'gpt2'" in load_error(path)


def test_cli_exits_2_with_one_line_on_a_truncated_gguf(good_gguf):

    good_gguf.write_bytes(good_gguf.read_bytes()[:-1000])
    run = hybridmoe("generate", "--model", str(good_gguf), "--prompt", "hi", timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(good_gguf) in errors[0] and "truncated" in errors[0]


def test_gguf_peak_rss_while_loading_is_at_most_1_5x_weights(tmp_path):
    """Experts come out of their stacks one at a time, so memory grows by about the weights only."""
    import subprocess
    import sys

    from tests.test_load_memory import SCRIPT, save_memory_test_model  # as for safetensors

    save_memory_test_model(tmp_path)  # ~170 MB fp32, ~85 MB as F16 GGUF
    big = write_gguf(tmp_path, tmp_path / "big.gguf", Q.F16)
    (tmp_path / "model.safetensors").unlink()
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    tiny_reference("mixtral", tiny)
    small = write_gguf(tiny, tiny / "tiny.gguf")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(big), str(small)],
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(out.stdout)
    assert m["weights"] > 150e6  # everything was loaded, as fp32
    assert (m["peak"] - m["base"]) / m["weights"] <= 1.5, m


def test_tokenizer_dir_overrides_gguf_metadata(smollm2, smol_tokenizer_dir):
    from hybridmoe.loader import load_tokenizer

    path, from_metadata, _ = smollm2
    from_dir = load_tokenizer(path, smol_tokenizer_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert from_dir.encode_chat(messages) == from_metadata.encode_chat(messages)
    assert from_dir.eos_ids == from_metadata.eos_ids


def test_gguf_without_a_vocabulary_asks_for_tokenizer_dir(good_gguf):
    from hybridmoe.errors import ModelFileError
    from hybridmoe.loader import load_tokenizer

    with pytest.raises(ModelFileError, match="--tokenizer DIR") as info:
        load_tokenizer(good_gguf)
    assert str(good_gguf) in str(info.value) and "\n" not in str(info.value)
