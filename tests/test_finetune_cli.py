"""`hybridmoe finetune` as users run it, on the tiny chat model (random weights, SmolLM2's tokenizer
and template): it writes a PEFT adapter that `generate --lora` takes, a killed run resumes to the
very same adapter, and every bad input is one line naming the problem, exit code 2."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.adapters import save_random_adapter
from tests.console import ROOT, hybridmoe
from tests.test_bad_input import one_error_line
from tests.tiny import build_tiny

CHAT = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hey."}]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Twelve short chats and two texts."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        }
        for i in range(12)
    ] + [{"text": "Plain text is learned whole."}, {"text": "So is this line."}]
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", rows)


def finetune(model, data, out, *extra) -> list[str]:
    return [
        "finetune", "--model", str(model), "--data", str(data), "--out", str(out),
        "--threads", "1", "--epochs", "2", "--batch-size", "4", *map(str, extra),
    ]  # fmt: skip


def test_finetune_writes_an_adapter_that_generate_takes(tiny_chat_model, data, tmp_path):
    run = hybridmoe(*finetune(tiny_chat_model, data, tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert config["target_parameters"]  # the routed experts
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["steps"] == 8 and len(state["held_out"]) == 3  # before, and after each epoch
    assert not (out / "checkpoint.pt").exists()  # a finished run leaves no checkpoint
    assert "epoch 2/2" in run.stderr and "tok_s" in run.stderr  # the progress bar's figures
    gen = hybridmoe(
        "generate", "--model", tiny_chat_model, "--lora", out, "--prompt", "Hi", "--max-tokens", 4
    )
    assert gen.returncode == 0, gen.stderr


def test_a_killed_run_resumes_to_the_same_adapter(tiny_chat_model, data, tmp_path):
    every_step = ("--epochs", 6, "--save-every", 1)
    assert (
        hybridmoe(*finetune(tiny_chat_model, data, tmp_path / "whole", *every_step)).returncode == 0
    )
    killed = tmp_path / "killed"
    args = finetune(tiny_chat_model, data, killed, *every_step)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridmoe", *args], cwd=ROOT, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not (killed / "checkpoint.pt").exists():  # killed just after its first checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = hybridmoe(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    again = load_file(str(killed / "adapter_model.safetensors"))
    assert whole.keys() == again.keys()
    assert all(bool((whole[k] == again[k]).all()) for k in whole)


# ---- bad input: one line, exit 2 ----


def test_a_malformed_jsonl_line_is_named_by_its_number(capsys, tiny_chat_model, tmp_path):
    bad = write_jsonl(tmp_path / "d.jsonl", [CHAT, '{"messages": [', CHAT])
    line = one_error_line(capsys, finetune(tiny_chat_model, bad, tmp_path / "o"))
    assert f"{bad}:2:" in line and "not valid JSON" in line


def test_a_line_of_the_wrong_shape_says_what_is_expected(capsys, tiny_chat_model, tmp_path):
    bad = write_jsonl(tmp_path / "d.jsonl", [CHAT, CHAT, {"prompt": "x"}])
    line = one_error_line(capsys, finetune(tiny_chat_model, bad, tmp_path / "o"))
    assert f"{bad}:3:" in line and '"messages"' in line and '"text"' in line


def test_a_chat_without_an_assistant_turn(capsys, tiny_chat_model, tmp_path):
    bad = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    line = one_error_line(capsys, finetune(tiny_chat_model, bad, tmp_path / "o"))
    assert f"{bad}:1:" in line and "assistant" in line


def test_an_empty_dataset(capsys, tiny_chat_model, tmp_path):
    empty = write_jsonl(tmp_path / "d.jsonl", [])
    line = one_error_line(capsys, finetune(tiny_chat_model, empty, tmp_path / "o"))
    assert str(empty) in line and "no examples" in line


def longer_than(model, data: Path, limit: int) -> int:
    """How many examples of `data` exceed `limit` tokens, counted by transformers' tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    n = 0
    for line in data.read_text().splitlines():
        row = json.loads(line)
        if "text" in row:
            ids = tok(row["text"]).input_ids + [tok.eos_token_id]
        else:
            text = tok.apply_chat_template(row["messages"], tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
        n += len(ids) > limit
    return n


def test_long_examples_are_truncated_or_skipped_and_counted(tiny_chat_model, data, tmp_path):
    n = longer_than(tiny_chat_model, data, 48)
    assert 0 < n < 14
    cut = hybridmoe(*finetune(tiny_chat_model, data, tmp_path / "a", "--max-seq-len", 48))
    assert cut.returncode == 0, cut.stderr
    assert f"{n} example(s) longer than --max-seq-len 48: truncated to 48 tokens" in cut.stderr
    skip = hybridmoe(
        *finetune(tiny_chat_model, data, tmp_path / "b", "--max-seq-len", 48, "--long", "skip")
    )
    assert skip.returncode == 0, skip.stderr
    assert f"{n} example(s) longer than --max-seq-len 48: skipped" in skip.stderr


def test_when_every_example_is_too_long_nothing_is_left(capsys, tiny_chat_model, data, tmp_path):
    args = finetune(tiny_chat_model, data, tmp_path / "o", "--max-seq-len", 4, "--long", "skip")
    line = one_error_line(capsys, args)
    assert "no example is left" in line and "--max-seq-len" in line


def test_a_rank_larger_than_a_target(capsys, tiny_chat_model, data, tmp_path):
    line = one_error_line(
        capsys, finetune(tiny_chat_model, data, tmp_path / "o", "--lora-rank", 100)
    )
    assert "--lora-rank 100 is larger than" in line and "give at most" in line


def test_dropout_on_expert_targets(capsys, tiny_chat_model, data, tmp_path):
    line = one_error_line(
        capsys, finetune(tiny_chat_model, data, tmp_path / "o", "--lora-dropout", 0.1)
    )
    assert "--lora-dropout 0.1" in line and "--targets attention" in line


def test_an_unknown_target(capsys, tiny_chat_model, data, tmp_path):
    line = one_error_line(
        capsys, finetune(tiny_chat_model, data, tmp_path / "o", "--targets", "foo")
    )
    assert "'foo'" in line and "q_proj" in line


def test_an_unfinished_run_is_not_overwritten_and_resume_needs_a_checkpoint(
    capsys, tiny_chat_model, data, tmp_path
):
    line = one_error_line(capsys, finetune(tiny_chat_model, data, tmp_path / "o", "--resume"))
    assert "no checkpoint.pt to resume from" in line
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "checkpoint.pt").write_bytes(b"x")
    line = one_error_line(capsys, finetune(tiny_chat_model, data, tmp_path / "o"))
    assert "pass --resume" in line


def test_an_adapter_made_for_another_model_is_refused_with_its_name(
    capsys, tiny_chat_model, tmp_path
):
    from hybridmoe.loader import load_model

    build_tiny("qwen3_moe", tmp_path / "other")
    save_random_adapter(load_model(tmp_path / "other", progress=False), tmp_path / "adapter")
    args = ["generate", "--model", str(tiny_chat_model), "--prompt", "hi", "--max-tokens", "2"]
    line = one_error_line(capsys, [*args, "--lora", str(tmp_path / "adapter")])
    assert "was made for 'tiny'" in line and "not this model" in line


def test_serve_lora_needs_name_equals_dir(capsys, tiny_chat_model):
    line = one_error_line(capsys, ["serve", "--model", str(tiny_chat_model), "--lora", "nodir"])
    assert "--lora nodir" in line and "NAME=DIR" in line


def test_a_directory_that_is_no_adapter(capsys, tiny_chat_model, tmp_path):
    args = ["generate", "--model", str(tiny_chat_model), "--prompt", "hi", "--max-tokens", "2"]
    line = one_error_line(capsys, [*args, "--lora", str(tmp_path)])
    assert str(tmp_path) in line and "adapter_config.json" in line


@pytest.fixture(scope="module")
def tiny_chat_gguf(tiny_chat_model, tmp_path_factory) -> Path:
    """The tiny chat model as a Q8_0 GGUF file (gate/up, attention and head in blocks; the down
    projections, 48 wide, stay F32), without a tokenizer: --tokenizer gives it."""
    from tests.gguf_writer import Q, write_gguf

    out = tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"
    return write_gguf(tiny_chat_model, out, Q.Q8_0)


def test_finetune_trains_on_a_gguf_file_with_its_blocks_kept(
    tiny_chat_gguf, tiny_chat_model, data, tmp_path
):
    tok = ["--tokenizer", tiny_chat_model]
    run = hybridmoe(*finetune(tiny_chat_gguf, data, tmp_path / "out"), *tok)
    assert run.returncode == 0, run.stderr
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["held_out"][-1] < state["held_out"][0]  # it learned through the blocks
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert any("experts" in name for name in adapter)
    gen = hybridmoe(
        "generate", "--model", tiny_chat_gguf, *tok, "--lora", tmp_path / "out",
        "--prompt", "Hi", "--max-tokens", 4,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr


def test_merge_refuses_a_gguf_file_saying_why_and_what_to_do(capsys, tiny_chat_gguf, tmp_path):
    from hybridmoe.loader import load_model

    save_random_adapter(load_model(tiny_chat_gguf, progress=False), tmp_path / "adapter")
    args = ["finetune", "merge", "--model", str(tiny_chat_gguf), "--adapter"]
    line = one_error_line(capsys, [*args, str(tmp_path / "adapter"), "--out", str(tmp_path / "m")])
    assert "blocks" in line and "--lora DIR" in line and "export" in line
    assert not (tmp_path / "m").exists()
