"""DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last decoder layer
(model.layers.61 in the real one); generation does not use it, so loading skips it, experts
included."""

import torch
from safetensors.torch import load_file, save_file

from hybridmoe.loader import load_model
from tests.tiny import build_tiny


def test_deepseek_v3_loads_past_its_mtp_layer(tmp_path):
    build_tiny("deepseek_v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {
        k.replace("layers.2.", "layers.3."): v.clone()
        for k, v in tensors.items()
        if ".layers.2." in k
    }
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP-only tensor
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, progress=False)
    assert len(model.layers) == 3
    assert {layer for layer, _ in model.runtime.store.records} == {1, 2}
