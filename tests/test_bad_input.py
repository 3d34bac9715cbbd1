"""Bad input on the Hugging Face path: one line naming the file and the problem, exit code 2, no
traceback. (Damaged GGUF files are covered in test_gguf.py.)"""

import json
from pathlib import Path

import pytest

from hybridmoe.cli import main
from tests.console import hybridmoe
from tests.tiny import build_tiny

VOCAB = 96  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer over the tiny vocabulary,
    so the CLI gets past the tokenizer to the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tokenizer")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(out)
    return out


@pytest.fixture
def model_dir(tmp_path) -> Path:
    build_tiny("llama", tmp_path)
    return tmp_path


def one_error_line(capsys, argv: list[str]) -> str:
    """Run the CLI; it must exit 2 and print exactly one error line (a progress bar may share
    stderr)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1, err
    return lines[0]


def generate(model, *extra) -> list[str]:
    return ["generate", "--model", str(model), "--prompt", "w5 w6", "--max-tokens", "2", *extra]


def test_missing_path(capsys, tmp_path):
    missing = tmp_path / "nowhere"
    line = one_error_line(capsys, generate(missing))
    assert str(missing) in line and "no such file" in line


def test_directory_without_config_json(capsys, tmp_path):
    line = one_error_line(capsys, generate(tmp_path))
    assert str(tmp_path) in line and "config.json" in line


def test_unsupported_architecture(capsys, model_dir, tokenizer_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(capsys, generate(model_dir, "--tokenizer", str(tokenizer_dir)))
    assert str(model_dir) in line and "GPT2LMHeadModel" in line and "not supported" in line


def test_truncated_safetensors(capsys, model_dir, tokenizer_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5000])
    line = one_error_line(capsys, generate(model_dir, "--tokenizer", str(tokenizer_dir)))
    assert str(weights) in line and "truncated" in line


def test_corrupt_safetensors_header(capsys, model_dir, tokenizer_dir):
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = (
        b"}{ not json at all, not at all }"  # the JSON header starts after its 8-byte length
    )
    weights.write_bytes(bytes(data))
    line = one_error_line(capsys, generate(model_dir, "--tokenizer", str(tokenizer_dir)))
    assert str(weights) in line and "corrupt" in line


def test_missing_tensor(capsys, model_dir, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    weights = model_dir / "model.safetensors"
    state = load_file(str(weights))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    line = one_error_line(capsys, generate(model_dir, "--tokenizer", str(tokenizer_dir)))
    assert str(model_dir) in line and "layers.1.self_attn.v_proj" in line


def test_tokenizer_not_found(capsys, model_dir):
    line = one_error_line(capsys, generate(model_dir))
    assert str(model_dir) in line and "--tokenizer" in line


def test_tokenizer_option_not_a_directory(capsys, model_dir, tmp_path):
    line = one_error_line(capsys, generate(model_dir, "--tokenizer", str(tmp_path / "no-such-dir")))
    assert "no-such-dir" in line


def test_a_tokenizer_larger_than_the_vocabulary(capsys, model_dir, smol_tokenizer_dir):
    """SmolLM2's 49152 tokens for a 96-token model: 'w5' is a token id past the embedding."""
    line = one_error_line(capsys, generate(model_dir, "--tokenizer", str(smol_tokenizer_dir)))
    assert "49152 tokens" in line and f"vocabulary has {VOCAB}" in line


def test_the_console_command_exits_2_without_a_traceback(tmp_path):
    run = hybridmoe("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi", timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().count("\n") == 0 and "nowhere" in run.stderr
