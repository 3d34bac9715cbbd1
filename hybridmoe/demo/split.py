"""Step 1 of the recipe: split an FFN's neurons into a shared expert (the neurons that matter for
most tokens) and equal routed experts (neurons that fire on the same tokens, grouped by balanced
k-means on their contribution profiles)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridmoe.demo.spec import MoESpec


def activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU hidden activations: x [T, H], gate/up [F, H] -> [T, F]."""
    return F.silu(x @ gate.T) * (x @ up.T)


def _balanced_assign(sim: torch.Tensor, cap: int) -> torch.Tensor:
    """Assign each row of sim [N, K] to a column, at most `cap` rows per column, greedily by
    similarity: every free row proposes to its best open column, which keeps the best."""
    n, k = sim.shape
    label = torch.full((n,), -1, dtype=torch.long)
    count = torch.zeros(k, dtype=torch.long)
    while (label < 0).any():
        free = (label < 0).nonzero().squeeze(1)
        open_sim = sim[free].masked_fill((count >= cap)[None, :], -math.inf)
        best = open_sim.argmax(dim=1)
        for c in best.unique().tolist():
            cand = free[best == c]
            take = cand[torch.argsort(sim[cand, c], descending=True)[: cap - int(count[c])]]
            label[take] = c
            count[c] += len(take)
    return label


def balanced_kmeans(feat: torch.Tensor, k: int, seed: int, iters: int = 12) -> torch.Tensor:
    """Equal-size clusters of the unit rows of feat [N, D] (spherical k-means); labels [N]."""
    g = torch.Generator().manual_seed(seed)
    centres = feat[torch.randperm(feat.shape[0], generator=g)[:k]].clone()  # [k, D]
    for _ in range(iters):
        label = _balanced_assign(feat @ centres.T, feat.shape[0] // k)
        for c in range(k):
            centres[c] = F.normalize(feat[label == c].mean(0), dim=0)
    return label


def split(
    h: torch.Tensor, down: torch.Tensor, spec: MoESpec, seed: int, sample: int = 16384
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared neuron ids [S] and routed experts [E, n] from activations h [T, F]."""
    contrib = h.abs() * down.norm(dim=0)  # [T, F] size of each neuron's output
    order = torch.argsort(contrib.pow(2).mean(0), descending=True)
    shared, rest = order[: spec.shared_size()], order[spec.shared_size() :]
    # neurons that fire on the same tokens belong together: cluster their contribution profiles
    feat = F.normalize(contrib[:sample, rest].T, dim=1)  # [R, sample]
    label = balanced_kmeans(feat, spec.experts, seed)
    experts = torch.stack([rest[label == e].sort().values for e in range(spec.experts)])
    return shared.sort().values, experts


def refine_split(
    h: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, picked: torch.Tensor
) -> torch.Tensor:
    """Experts [E, n] regrouped to suit a router: each routed neuron moves (at most n per
    expert) to the expert whose tokens, as the router picks them (ids [T, k]), hold the largest
    share of its output energy. Alternating this with retraining the router cut the held-out
    error after the refit (docs/notes/2026-11-21-demo-model-recipe.md)."""
    rest = experts.flatten().sort().values  # [R]
    energy = (h[:, rest] * down[:, rest].norm(dim=0)).pow(2)  # [T, R]
    chosen = torch.zeros(h.shape[0], experts.shape[0]).scatter(1, picked, 1.0)  # [T, E]
    captured = energy.T @ chosen  # [R, E]
    label = _balanced_assign(captured / captured.sum(1, keepdim=True), experts.shape[1])
    return torch.stack([rest[label == e].sort().values for e in range(experts.shape[0])])


def expert_outputs_norm(h: torch.Tensor, down: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, E]: the size of each routed expert's output per token (the oracle's score)."""
    return torch.stack([(h[:, ids] @ down[:, ids].T).norm(dim=1) for ids in experts], dim=1)
