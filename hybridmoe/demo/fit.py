"""The recipe that turns SmolLM2's dense SwiGLU FFNs into sparse MoEs, fitted on the dense
model's own hidden states (distillation), layer after layer:

1. split (split.py) — a shared expert of the neurons that matter for most tokens, and equal
   routed experts of neurons that fire together;
2. route (router.py) — a linear router trained to pick each token's largest experts;
3. refit (here) — with the routing fixed, the down projections are refitted by ridge least
   squares so that the layer puts the MoE model's residual stream back on the dense model's.

Layers are fitted in order on the calibration text as the MoE model built so far sees it, so each
refit corrects what earlier layers got wrong instead of letting the errors compound. Figures and
the variants that did not help: docs/notes/2026-11-21-demo-model-recipe.md. `python -m
hybridmoe.demo.fit` reproduces the data shipped in hybridmoe/demo/data, with which a build of the
default configuration skips the fit (downs.py).
"""

from __future__ import annotations

import torch

from hybridmoe.demo import stream
from hybridmoe.demo.router import neuron_weights, route, train_router
from hybridmoe.demo.spec import DEFAULT_SPEC, LayerMoE, MoESpec
from hybridmoe.demo.split import activations, expert_outputs_norm, refine_split, split
from hybridmoe.errors import UserError

__all__ = ["DEFAULT_SPEC", "LayerMoE", "MoESpec", "fit_model", "RECIPE_VERSION"]

# bump when the recipe or what a build writes changes: cached builds and shipped data of the old
# one are not reused (v5: the default build applies shipped downs, rounded as downs.py says)
RECIPE_VERSION = 5
# relative to the activations' mean energy; chosen on calibration rows held out of the fit
# (validation perplexity / dense at 33k fit tokens: 0.07 1.447, 0.15 1.441, 0.3 1.455)
RIDGE = 0.15
REFINE_ROUNDS = (
    3  # split and router fitted (shipped plans, other specs): experts regrouped around the router
)


def refit_down(z: torch.Tensor, y: torch.Tensor, down: torch.Tensor):
    """Down projection [H, F] minimising |z @ D.T - y|² + λ|D - down|² (z: weighted
    activations [T, F], y: the dense output [T, H]); λ is relative to z's mean energy, and
    pulling toward the dense weights keeps rarely used neurons sane."""
    gram = z.T @ z  # [F, F]
    lam = RIDGE * gram.diagonal().mean()
    a = gram + lam * torch.eye(gram.shape[0])
    return torch.linalg.solve(a, z.T @ y + lam * down.T).T


def start_down(down: torch.Tensor, experts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Where the refit of a down projection [H, F] starts from, and is pulled toward: the dense
    one, its routed columns times top_k, as routed weights sum to 1."""
    start = down.clone()
    start[:, experts.flatten()] *= top_k
    return start


def refit(
    x: torch.Tensor,
    h: torch.Tensor,
    target: torch.Tensor,
    down: torch.Tensor,
    shared: torch.Tensor,
    experts: torch.Tensor,
    router: torch.Tensor,
    spec: MoESpec,
) -> tuple[LayerMoE, torch.Tensor]:
    """With the split and router fixed, refit the down projections to `target` [T, H]; the
    layer and the MoE FFN's output on x with them [T, H]."""
    start = start_down(down, experts, spec.top_k)
    z = h * neuron_weights(x, shared, experts, router, spec.top_k, spec.ffn)  # [T, F]
    plan = LayerMoE(shared, experts, router, refit_down(z, target, start))
    return plan, z @ plan.down.T


def fit_layer(
    x: torch.Tensor,
    target: torch.Tensor,
    gate,
    up,
    down,
    spec: MoESpec,
    seed: int,
    given: LayerMoE | None = None,
) -> tuple[LayerMoE, torch.Tensor]:
    """Split, route and refit one FFN on its inputs x [T, H] toward target [T, H] (what the dense
    model's residual stream needs from this FFN): the layer's MoE, and its output on x [T, H].
    `given` supplies a shipped split and router, leaving only the refit to do. The ridge
    (relative to the activations' mean energy) was chosen on held-out tokens: 0.1-1
    generalises, 1e-3 overfits (docs/notes/2026-11-21-demo-model-recipe.md)."""
    h = activations(x, gate, up)  # [T, F]
    if given is None:
        shared, experts = split(h, down, spec, seed)
        for _ in range(REFINE_ROUNDS):  # split and router adapt to each other
            router = train_router(x, expert_outputs_norm(h, down, experts), spec.top_k)
            experts = refine_split(h, down, experts, route(x, router, spec.top_k)[0])
        router = train_router(
            x, expert_outputs_norm(h, down, experts), spec.top_k, sample=x.shape[0]
        )
    else:
        shared, experts, router = given.shared, given.experts, given.router
    return refit(x, h, target, down, shared, experts, router, spec)


def dense_llama(dense: dict, config: dict):
    """transformers' Llama on the dense weights, only to sample the corpus (its `generate`) and as
    the evaluation's reference (quality.py); the fit runs hybridmoe's own Llama (stream.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    known = LlamaConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "rope_scaling")}
    )
    with torch.device("meta"):  # no random init: every weight is assigned below
        model = LlamaForCausalLM(known)
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    # the rotary table is a computed buffer, not a weight: make it for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config=known)
    return model.eval()


def corpus(name: str, model=None):
    """The shipped "calibration" or "evaluation" text, or (when the package lacks it) the same
    recipe generated now by the dense `model` (transformers' Llama, see dense_llama; by default
    the whole dense SmolLM2)."""
    from hybridmoe.demo import calibration, shipped, source

    found = shipped.load_corpus(name)
    if found is not None:
        return found
    model = model if model is not None else dense_llama(*source.read_dense())
    if name == "calibration":
        texts = calibration.prompts(calibration.CALIBRATION_TOPICS, CALIBRATION_PROMPTS, seed=0)
        return calibration.generate(model, source.tokenizer(), texts, GENERATED_TOKENS, seed=0)
    texts = calibration.prompts(calibration.EVALUATION_TOPICS, EVALUATION_PROMPTS, EVALUATION_SEED)
    return calibration.generate(model, source.tokenizer(), texts, GENERATED_TOKENS, EVALUATION_SEED)


GENERATED_TOKENS = 128  # per answer
CALIBRATION_PROMPTS = 256  # ~39k tokens
CALIBRATION_TOKENS = 40000  # per build: all of the shipped text (see docs)
EVALUATION_PROMPTS, EVALUATION_SEED = 32, 1000  # ~3.5k scored tokens, other topics


def fit_model(
    dense: dict,
    config: dict,
    spec: MoESpec,
    tokens: int = CALIBRATION_TOKENS,
    progress: bool = True,
) -> list[LayerMoE]:
    """Every layer's MoE, fitted layer after layer on the calibration text as the MoE model so
    far sees it: each FFN is fitted on its own (already approximate) inputs, toward what the
    dense model's residual stream needs, so errors of earlier layers are corrected rather than
    compounded. A plan shipped for `spec` supplies split and routers; otherwise they are fitted
    here (slower). The down projections are refitted in both cases."""
    from tqdm import tqdm

    from hybridmoe.demo import shipped

    model = stream.dense_model(dense, config)
    calib = corpus("calibration")
    given = shipped.load_plan(shipped.plan_path(spec.tag()), spec.as_dict(), RECIPE_VERSION)
    rows = _rows_for(calib.mask, tokens)
    # 16 sequences a batch, laid end to end without their padding
    batches = [
        stream.real_tokens(calib.ids[s : s + 16], calib.mask[s : s + 16])
        for s in range(0, rows, 16)
    ]
    inputs = [stream.embed(model, seqs) for seqs in batches]  # (hidden, cos_sin, seq_lens)
    dense_h = [h for h, _, _ in inputs]  # per batch [T_b, H]
    moe_h = [h.clone() for h in dense_h]
    plans = []
    for i, layer in enumerate(
        tqdm(model.layers, desc="demo model: fitting experts", unit="layer", disable=not progress)
    ):
        p = f"model.layers.{i}.mlp"
        gate, up, down = (dense[f"{p}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        halves, x, target = _through_attention(layer, dense_h, moe_h, inputs)
        g = None if given is None else LayerMoE(**given[i], down=None)
        plan, out = fit_layer(x, target, gate, up, down, spec, i, g)  # out [T, H]
        moe_h = [r + o for (r, _), o in zip(halves, out.split([len(r) for r, _ in halves]))]
        plans.append(plan)
    return plans


@torch.no_grad()
def _through_attention(layer, dense_h: list, moe_h: list, inputs: list):
    """Advance the dense stream through the whole layer (in place) and the MoE stream up to its
    FFN: the MoE stream's (residual, FFN input) per batch, and over all tokens the FFN inputs
    [T, H] and the targets [T, H] that would put the MoE stream back on the dense one."""
    halves, xs, targets = [], [], []
    for b, (_, cos_sin, seq_lens) in enumerate(inputs):
        resid_d, x_d = stream.attention_half(layer, dense_h[b], cos_sin, seq_lens)
        dense_h[b] = resid_d + layer.mlp(x_d)
        resid_m, x_m = stream.attention_half(layer, moe_h[b], cos_sin, seq_lens)
        halves.append((resid_m, x_m))
        xs.append(x_m)
        targets.append(dense_h[b] - resid_m)
    return halves, torch.cat(xs), torch.cat(targets)


def _rows_for(mask: torch.Tensor, tokens: int) -> int:
    """How many corpus rows hold about `tokens` real tokens."""
    total = mask.sum(dim=1).cumsum(0)
    return min(int((total < tokens).sum()) + 1, mask.shape[0])


def regenerate_corpus() -> None:
    """Write demo/data/corpus.safetensors anew: the dense model's answers to the calibration and
    evaluation prompts (a few minutes on 2 cores)."""
    from hybridmoe.demo import calibration, shipped, source

    model = dense_llama(*source.read_dense())
    tok = source.tokenizer()
    calib = calibration.generate(
        model,
        tok,
        calibration.prompts(calibration.CALIBRATION_TOPICS, CALIBRATION_PROMPTS, seed=0),
        GENERATED_TOKENS,
        seed=0,
    )
    evaluation = calibration.generate(
        model,
        tok,
        calibration.prompts(calibration.EVALUATION_TOPICS, EVALUATION_PROMPTS, EVALUATION_SEED),
        GENERATED_TOKENS,
        EVALUATION_SEED,
    )
    shipped.save_corpus(calib, evaluation)


def ship_plan(spec: MoESpec, downs_only: bool = False) -> None:
    """Fit `spec` and write what builds of it then apply instead of fitting: its split and
    routers (fitted from scratch, unless `downs_only` keeps the shipped ones) and its down
    projections (demo/data/plan-<tag>, downs-<tag>)."""
    from hybridmoe.demo import downs, shipped, source

    path = shipped.plan_path(spec.tag())
    if downs_only and shipped.load_plan(path, spec.as_dict(), RECIPE_VERSION) is None:
        raise UserError(
            f"no split and routers ship for {spec.tag()} (recipe v{RECIPE_VERSION}); "
            "run without --downs to fit them too."
        )
    if not downs_only:
        path.unlink(missing_ok=True)  # fit from scratch, not from the plan being replaced
    dense, config = source.read_dense()
    plans = fit_model(dense, config, spec)
    if not downs_only:
        shipped.save_plan(path, plans, spec.as_dict(), RECIPE_VERSION)
        print(path)
    starts = [
        start_down(dense[f"model.layers.{i}.mlp.down_proj.weight"], p.experts, spec.top_k)
        for i, p in enumerate(plans)
    ]
    out = downs.downs_path(spec.tag())
    downs.save(out, plans, starts, spec, RECIPE_VERSION, source.digest())
    print(out)


def main(argv: list[str] | None = None) -> int:
    """`python -m hybridmoe.demo.fit [--corpus] [--downs] [--experts N --top-k K --shared F]`:
    reproduce the data shipped in hybridmoe/demo/data (deterministic on one machine and thread
    count; 2 threads here)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m hybridmoe.demo.fit", description=main.__doc__)
    p.add_argument("--corpus", action="store_true", help="regenerate the corpus first")
    p.add_argument(
        "--downs",
        action="store_true",
        help="keep the shipped split and routers; refit and write the down projections only "
        "(minutes instead of a quarter of an hour)",
    )
    p.add_argument("--experts", type=int, default=DEFAULT_SPEC.experts)
    p.add_argument("--top-k", type=int, default=DEFAULT_SPEC.top_k)
    p.add_argument("--shared", type=float, default=DEFAULT_SPEC.shared)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    try:
        spec = MoESpec(args.experts, args.top_k, args.shared).validate()
        if args.corpus:
            regenerate_corpus()
        ship_plan(spec, args.downs)
    except UserError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
