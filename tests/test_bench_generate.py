"""`hybridmoe bench make-model` and `bench generate` end to end on a tiny model (no timing
assertions)."""

import json

from hybridmoe.cli import main


def test_make_model_then_bench_generate_reports_both_engines(tmp_path, capsys):
    model = tmp_path / "bench-model"
    assert (
        main(["bench", "make-model", "--shape", "tiny", "--layers", "2", "--out", str(model)]) == 0
    )
    assert (model / "config.json").exists() and list(model.glob("*.safetensors"))
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith(".")
    ]  # no temporary directory left
    capsys.readouterr()
    code = main(
        [
            "bench",
            "generate",
            "--model",
            str(model),
            "--prompt-len",
            "5",
            "--max-tokens",
            "4",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--compare-transformers",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_len"] == 5 and result["max_tokens"] == 4 and result["dtype"] == "bf16"
    for engine in ("hybridmoe", "transformers"):
        r = result[engine]
        assert r["prefill_tps"] > 0 and r["decode_tps"] > 0
        assert len(r["prefill_runs"]) == 2 and len(r["decode_runs"]) == 2
    assert result["decode_ratio"] > 0 and result["prefill_ratio"] > 0
    assert {"platform", "torch", "cpus"} <= set(result["machine"])


def test_bench_generate_without_transformers_prints_a_table(tmp_path, capsys):
    model = tmp_path / "m"
    main(
        [
            "bench",
            "make-model",
            "--shape",
            "tiny",
            "--layers",
            "1",
            "--out",
            str(model),
            "--dtype",
            "fp32",
        ]
    )
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "generate",
                "--model",
                str(model),
                "--dtype",
                "fp32",
                "--prompt-len",
                "3",
                "--max-tokens",
                "2",
                "--repeats",
                "1",
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "hybridmoe" in out and "decode tok/s" in out and "transformers" not in out.splitlines()[-1]
    )


def test_make_model_refuses_an_existing_directory(tmp_path, capsys):
    assert main(["bench", "make-model", "--shape", "tiny", "--out", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err


def test_bench_generate_rejects_a_zero_token_count(tmp_path, capsys):
    model = tmp_path / "m"
    main(["bench", "make-model", "--shape", "tiny", "--layers", "1", "--out", str(model)])
    assert main(["bench", "generate", "--model", str(model), "--max-tokens", "0"]) == 2
    assert "--max-tokens 0" in capsys.readouterr().err
