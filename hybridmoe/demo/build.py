"""Build the demo MoE: SmolLM2-135M-Instruct's FFNs split into routed experts, saved as a Hugging
Face directory that transformers loads with its own class (Mixtral without a shared expert,
Qwen2-MoE with one).

The directory is written beside its target under a temporary name and moved into place with one
`os.replace`, so a build killed halfway leaves nothing that a later run would load.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridmoe.demo import downs, source
from hybridmoe.demo.fit import CALIBRATION_TOKENS, RECIPE_VERSION, fit_model
from hybridmoe.demo.spec import DEFAULT_SPEC, LayerMoE, MoESpec
from hybridmoe.errors import UserError

WEIGHTS = "model.safetensors"

__all__ = ["MoESpec", "DEFAULT_SPEC", "RECIPE_VERSION", "build", "is_complete"]


def is_complete(path: Path) -> bool:
    """True for a finished build (an interrupted one never appears under its final name) whose
    weights file is whole: its header reads and the file is as long as the header says."""
    return (path / "config.json").is_file() and weights_whole(path / WEIGHTS)


def weights_whole(file: Path) -> bool:
    """Whether a safetensors file has its header and every byte of data the header places."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > file.stat().st_size:
                return False
            header = json.loads(f.read(size))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
        return file.stat().st_size == 8 + size + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def remove_stale(out: Path) -> None:
    """Delete what interrupted builds of `out` left (a SIGKILL or SIGTERM skips their cleanup):
    the temporary folders of processes that are gone."""
    for left in out.parent.glob(f".{out.name}.*-*"):
        pid = left.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _expert_tensors(prefix: str, names: tuple[str, str, str], gate, up, down) -> dict:
    g, u, d = names
    return {
        f"{prefix}.{g}.weight": gate.contiguous(),
        f"{prefix}.{u}.weight": up.contiguous(),
        f"{prefix}.{d}.weight": down.contiguous(),
    }


def _layer_tensors(i: int, dense: dict, plan: LayerMoE, spec: MoESpec) -> dict:
    """One layer's MoE tensors under the checkpoint names of Mixtral or Qwen2-MoE."""
    p = f"model.layers.{i}"
    gate, up = dense[f"{p}.mlp.gate_proj.weight"], dense[f"{p}.mlp.up_proj.weight"]  # [F, H]
    out = {}
    if spec.shared_size() == 0:
        moe, names = f"{p}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        moe, names = f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")
        sh = plan.shared
        # Qwen2-MoE scales the shared expert by sigmoid(gate · x); a zero gate gives exactly 1/2,
        # so the shared down projection is doubled to keep the shared expert exact.
        out[f"{moe}.shared_expert_gate.weight"] = torch.zeros(1, gate.shape[1])
        out.update(
            _expert_tensors(f"{moe}.shared_expert", names, gate[sh], up[sh], 2.0 * plan.down[:, sh])
        )
        for proj in ("q", "k", "v"):  # Qwen2-MoE has q/k/v biases; Llama has none
            w = dense[f"{p}.self_attn.{proj}_proj.weight"]
            out[f"{p}.self_attn.{proj}_proj.bias"] = torch.zeros(w.shape[0])
    out[f"{moe}.gate.weight"] = plan.router
    for e, ids in enumerate(plan.experts):
        out.update(
            _expert_tensors(f"{moe}.experts.{e}", names, gate[ids], up[ids], plan.down[:, ids])
        )
    return out


def moe_state_dict(dense: dict, plans: list[LayerMoE], spec: MoESpec) -> dict:
    """The full checkpoint: dense attention, norms and embeddings, MoE FFNs (tied lm_head)."""
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i, plan in enumerate(plans):
        out.update(_layer_tensors(i, dense, plan, spec))
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def moe_config(dense_config: dict, spec: MoESpec):
    """A transformers config object for the MoE (its class decides the architecture)."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    keep = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    common = {k: dense_config[k] for k in keep}
    common.update(num_experts_per_tok=spec.top_k, torch_dtype="float32")
    # `architectures` names the class, as a saved transformers model's config does: tools that
    # dispatch on it (llama.cpp's converter among them) need it
    if spec.shared_size() == 0:
        return MixtralConfig(
            architectures=["MixtralForCausalLM"],
            **common,
            head_dim=dense_config["head_dim"],
            intermediate_size=spec.expert_size(),
            num_local_experts=spec.experts,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    # Qwen2-MoE derives head_dim as hidden / heads, which is SmolLM2's 576 / 9 = 64
    return Qwen2MoeConfig(
        **common,
        architectures=["Qwen2MoeForCausalLM"],
        intermediate_size=spec.ffn,
        num_experts=spec.experts,
        moe_intermediate_size=spec.expert_size(),
        shared_expert_intermediate_size=spec.shared_size(),
        norm_topk_prob=True,
        qkv_bias=True,
        use_sliding_window=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def write_tokenizer(out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template inside it too) from the GGUF."""
    tok = source.tokenizer()
    tok.save_pretrained(str(out))
    # transformers 5 puts the template in chat_template.jinja only; older readers look here
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("chat_template", tok.chat_template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def fitted_plans(
    dense: dict, config: dict, spec: MoESpec, tokens: int, progress: bool
) -> tuple[list[LayerMoE], bool]:
    """Every layer's MoE, and whether the shipped fit supplied them: a full build of a
    configuration whose downs ship applies them (seconds), any other fits them here (minutes)."""
    if tokens == CALIBRATION_TOKENS:
        layers = config["num_hidden_layers"]
        plans = downs.shipped_plans(dense, spec, layers, RECIPE_VERSION, source.digest())
        if plans is not None:
            return plans, True
    return fit_model(dense, config, spec, tokens=tokens, progress=progress), False


def _write(
    tmp: Path,
    dense: dict,
    config: dict,
    plans: list[LayerMoE],
    spec: MoESpec,
    seconds: float,
    shipped: bool,
) -> None:
    moe_config(config, spec).save_pretrained(str(tmp))
    save_file(moe_state_dict(dense, plans, spec), str(tmp / WEIGHTS), metadata={"format": "pt"})
    write_tokenizer(tmp)
    (tmp / "hybridmoe_demo.json").write_text(
        json.dumps(
            {
                "recipe_version": RECIPE_VERSION,
                "source": source.FILENAME,
                **spec.as_dict(),
                "active_fraction": spec.active_fraction(),
                "fit_seconds": round(seconds, 1),
                "downs": "shipped" if shipped else "fitted here",
            },
            indent=2,
        )
    )


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists():  # --force: the old build goes aside first, then is deleted
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)


def truncate(dense: dict, config: dict, layers: int) -> tuple[dict, dict]:
    """The first `layers` layers only: a reduced model for fast tests (same shapes otherwise)."""
    keep = {
        k: v
        for k, v in dense.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    return keep, {**config, "num_hidden_layers": layers}


def build(
    out: Path,
    spec: MoESpec = DEFAULT_SPEC,
    progress: bool = True,
    layers: int | None = None,
    tokens: int = CALIBRATION_TOKENS,
) -> Path:
    """Build the demo MoE into `out` (replacing what is there) and return `out`. `layers` and
    `tokens` make a reduced build (first layers only, less calibration text) for tests."""
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; give --out a directory path.")
    remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        start = time.time()
        dense, config = source.read_dense()
        if layers is not None:
            dense, config = truncate(dense, config, layers)
        plans, shipped = fitted_plans(dense, config, spec, tokens, progress)
        _write(tmp, dense, config, plans, spec, time.time() - start, shipped)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
