"""Loading streams tensor by tensor: peak resident memory stays within 1.5x the loaded weights."""

import json
import subprocess
import sys

import torch

from tests.tiny import build_tiny

SCRIPT = r"""
import json, sys
from hybridmoe.loader import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

# A first, tiny load pays the one-time costs (lazy imports, allocator arenas: ~100 MB measured),
# so that what follows measures how memory grows with the weights.
load_model(sys.argv[2], progress=False)
base = status("VmRSS")
model = load_model(sys.argv[1], progress=False)
params = sum(p.numel() * p.element_size() for p in model.parameters())
experts = model.runtime.store.total_nbytes() if model.runtime else 0
print(json.dumps({"base": base, "peak": status("VmHWM"), "weights": params + experts}))
"""


def save_memory_test_model(path, **save: object) -> None:
    """A random Mixtral of ~170 MB fp32 (4 layers of 8 experts): large enough to see peak memory."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    MixtralForCausalLM(cfg).save_pretrained(path, **save)


def test_peak_rss_while_loading_is_at_most_1_5x_weights(tmp_path):
    save_memory_test_model(tmp_path, max_shard_size="40MB")  # ~170 MB in several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    tiny = tmp_path / "tiny"
    build_tiny("mixtral", tiny)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(tiny)],
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(out.stdout)
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))  # top level only
    assert abs(m["weights"] - on_disk) < 0.01 * on_disk  # everything was loaded
    ratio = (m["peak"] - m["base"]) / m["weights"]
    assert ratio <= 1.5, m
    print(f"peak RSS growth / weights = {ratio:.2f}")
