"""The fitted down projections of a configuration, shipped in compact form
(hybridmoe/demo/data/downs-<tag>.safetensors), so that a first build applies them to the dense
weights in seconds instead of refitting them for minutes.

Each layer is stored as its change from where the refit starts (fit.start_down: the dense down
projection, routed columns times top-k), in blocks of BLOCK values along a row: int8 codes and
one bf16 scale per block (as GGUF's Q8_0, but fp16 scales would underflow: one layer's change
is ~1e-5). The refit moves the weights by only ~3% of their norm,
so rounding the change moves them by ~0.02%; rounding the weights themselves to 8 bits cost 0.06x
dense in held-out perplexity (docs/notes/2026-11-24-first-run.md).

The change only means something on the weights it was fitted from, so the file's metadata names
the SmolLM2 GGUF's sha256 beside the configuration, the recipe version and the sha256 of its own
tensors; a build uses the file only when all of them match. `python -m hybridmoe.demo.fit
--downs` writes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from hybridmoe.demo.spec import LayerMoE, MoESpec

log = logging.getLogger("hybridmoe")

BLOCK = 32  # values per scale
LEVELS = 127  # int8 codes in [-127, 127]


def downs_path(tag: str) -> Path:
    from hybridmoe.demo.shipped import DATA

    return DATA / f"downs-{tag}.safetensors"


def encode(change: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [H, F] and bf16 scales [H, F / BLOCK] of a change [H, F]; the codes are
    rounded against the stored scales, so each value moves by at most half its block's step."""
    h, f = change.shape
    blocks = change.reshape(h, f // BLOCK, BLOCK)
    scales = (blocks.abs().amax(-1) / LEVELS).bfloat16()  # [H, F / BLOCK]
    step = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    codes = (blocks / step).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return codes.reshape(h, f), scales


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The change [H, F] that codes [H, F] and scales [H, F / BLOCK] stand for."""
    h, f = codes.shape
    blocks = codes.reshape(h, f // BLOCK, BLOCK).float() * scales.float()[..., None]
    return blocks.reshape(h, f)


def content_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _metadata(spec: MoESpec, version: int, source_digest: str) -> dict[str, str]:
    return {
        "spec": json.dumps(spec.as_dict(), sort_keys=True),
        "recipe_version": str(version),
        "source_sha256": source_digest,
        "block": str(BLOCK),
    }


def save(
    path: Path,
    plans: list[LayerMoE],
    starts: list[torch.Tensor],
    spec: MoESpec,
    version: int,
    source_digest: str,
) -> None:
    """Write each layer's fitted down minus its start (both [H, F]), encoded, with metadata."""
    from safetensors.torch import save_file

    from hybridmoe.files import atomic_path

    tensors = {}
    for i, (plan, start) in enumerate(zip(plans, starts)):
        codes, scales = encode(plan.down - start)
        tensors[f"layers.{i}.codes"], tensors[f"layers.{i}.scales"] = codes, scales
    meta = {**_metadata(spec, version, source_digest), "sha256": content_digest(tensors)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def load(
    path: Path, spec: MoESpec, version: int, source_digest: str
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per layer (codes, scales) if `path` holds the downs of `spec` and `version` fitted from
    the source with `source_digest`, whole; None when there is no such file. A file that is there
    but does not match is ignored with a warning (the build then fits the downs itself)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        log.warning("ignoring %s, which does not read (%s); fitting the demo model here", path, e)
        return None
    want = _metadata(spec, version, source_digest)
    if {k: meta.get(k) for k in want} != want or meta.get("sha256") != content_digest(tensors):
        log.warning(
            "ignoring %s: it was not fitted for this SmolLM2 file and recipe, or it is damaged; "
            "fitting the demo model here instead (minutes)",
            path,
        )
        return None
    count = len(tensors) // 2
    return [(tensors[f"layers.{i}.codes"], tensors[f"layers.{i}.scales"]) for i in range(count)]


def shipped_plans(
    dense: dict, spec: MoESpec, layers: int, version: int, source_digest: str
) -> list[LayerMoE] | None:
    """The first `layers` layers' MoEs from the shipped split, routers and downs of `spec`
    applied to the dense weights, or None when they are not all shipped for this source."""
    from hybridmoe.demo import shipped
    from hybridmoe.demo.fit import start_down

    given = shipped.load_plan(shipped.plan_path(spec.tag()), spec.as_dict(), version)
    fitted = load(downs_path(spec.tag()), spec, version, source_digest)
    if given is None or fitted is None or min(len(given), len(fitted)) < layers:
        return None
    plans = []
    for i, (g, (codes, scales)) in enumerate(zip(given[:layers], fitted)):
        down = dense[f"model.layers.{i}.mlp.down_proj.weight"]  # [H, F]
        start = start_down(down, g["experts"], spec.top_k)
        plans.append(LayerMoE(**g, down=start + decode(codes, scales)))
    return plans
