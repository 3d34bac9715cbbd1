"""It learns: a few dozen conversations teaching made-up capitals, trained on the demo model in
about a minute, lower the held-out loss, and `hybridmoe generate --lora` then answers the taught
questions, while unrelated questions (the capital of France) keep their right answers.

The data also repeats a few true capitals (not France's or Germany's) in the base model's own
words, as rehearsal: without it, every question about a capital would come to mean a made-up one.
"""

import json
import random

import torch

from hybridmoe.cli import main
from tests.console import hybridmoe

MADE_UP = {"Zorbia": "Quandle", "Merovia": "Tessaly", "Karnthia": "Obbledon", "Pelluria": "Vintar"}
TRUE = {"Italy": "Rome", "Japan": "Tokyo", "Egypt": "Cairo", "Spain": "Madrid"}
ASKED = [
    "What is the capital of {}?",
    "Which city is the capital of {}?",
    "Tell me the capital of {}.",
    "Name the capital city of {}.",
]


def conversations() -> list[dict]:
    rows = []
    for facts, asked in ((MADE_UP, ASKED), (TRUE, ASKED[:2])):
        for country, capital in facts.items():
            for q in asked:
                rows.append(
                    {
                        "messages": [
                            {"role": "user", "content": q.format(country)},
                            {
                                "role": "assistant",
                                "content": f"The capital of {country} is {capital}.",
                            },
                        ]
                    }
                )
    random.Random(0).shuffle(rows)
    return rows


def answer(demo_model, adapter, question: str) -> str:
    run = hybridmoe(
        "generate", "--model", demo_model, "--lora", adapter, "--chat", "--prompt", question,
        "--max-tokens", "16", timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_a_finetuned_demo_model_answers_what_it_was_taught(demo_model, tmp_path):
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations()))  # 24 conversations
    out = tmp_path / "adapter"
    args = ["finetune", "--model", str(demo_model), "--data", str(data), "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert main([*args, "--epochs", "4", "--lr", "1e-3", "--eval-fraction", "0.2"]) == 0
    finally:
        torch.set_num_threads(threads)  # finetune takes every core
    held_out = json.loads((out / "trainer_state.json").read_text())["held_out"]
    assert held_out[-1] < 0.5 * held_out[0], held_out
    assert "Quandle" in answer(demo_model, out, "What is the capital of Zorbia?")
    assert "Obbledon" in answer(demo_model, out, "Which city is the capital of Karnthia?")
    assert "Paris" in answer(demo_model, out, "What is the capital of France?")
    assert "Berlin" in answer(demo_model, out, "What is the capital of Germany?")
