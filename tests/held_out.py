"""Perplexity of a model on the demo corpus's held-out text, through our engine (a contiguous KV
cache per sequence, tests/contiguous_kv.py): the test of Q8_0's cost (test_quant_models.py) and the
figures of the demo model per file format in docs/benchmarks.md.

    python -m tests.held_out MODEL [MODEL ...]   # from the repository root
"""

from __future__ import annotations

import math
import sys

import torch

from tests.contiguous_kv import BatchKVContext, SequenceKV


def held_out_stats(path: str, sequences: int = 8) -> tuple[float, torch.Tensor]:
    """Perplexity over the demo corpus's held-out tokens (its first `sequences` rows), and the top
    tokens."""
    from hybridmoe.demo.shipped import load_corpus
    from hybridmoe.loader import load_model

    model, text = load_model(path, progress=False), load_corpus("evaluation")
    nll, count, tops = 0.0, 0, []
    with torch.inference_mode():
        for row, m, sc in list(zip(text.ids, text.mask, text.scored))[:sequences]:
            toks = row[m]
            hidden = model(
                toks, torch.arange(len(toks)), BatchKVContext([SequenceKV()], [len(toks)])
            )
            logits, scored = model.logits(hidden)[:-1], sc[m][1:]
            nll -= (
                torch.log_softmax(logits, -1).gather(-1, toks[1:, None])[:, 0][scored].sum().item()
            )
            count += int(scored.sum())
            tops.append(logits.argmax(-1)[scored])
    return math.exp(nll / count), torch.cat(tops)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for model_path in sys.argv[1:]:
        ppl, tops = held_out_stats(model_path, sequences=32)
        print(f"{model_path}\tperplexity {ppl:.3f}\tscored tokens {len(tops)}")
