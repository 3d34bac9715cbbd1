"""`hybridmoe bench make-model` and `bench generate` end to end on a tiny model (no timing
assertions)."""

import json

import pytest

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


@pytest.mark.parametrize("in_place", [False, True])
def test_engine_worker_process_runs_our_engine_and_reports_its_memory(tmp_path, in_place):
    """--compare-llama-cpp's worker protocol on our engine alone (llama.cpp is a benchmark peer,
    not a test dependency): the same greedy tokens as in this process, and its own RSS; with
    --in-place its blocks read where they lie in the file, the same tokens."""
    from hybridmoe.bench.compare_llama_cpp import Worker
    from hybridmoe.engine.generate import generate_ids
    from hybridmoe.engine.sampler import SamplingParams
    from hybridmoe.loader import load_model

    model = tmp_path / "m.gguf"
    args = ["bench", "make-model", "--shape", "tiny", "--layers", "1", "--format", "gguf-q8_0"]
    assert main([*args, "--out", str(model)]) == 0
    prompt = [5, 9, 40, 7, 100, 3]
    worker = Worker("hybridmoe", str(model), 1, "float32", 64, in_place)
    try:
        prefill_s, decode_s, steps = worker(prompt, 6)
    finally:
        worker.close()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = list(generate_ids(load_model(model, progress=False), prompt, params))
    assert worker.last["tokens"] == want and steps == 5 and prefill_s > 0 and decode_s > 0
    assert worker.last["peak_rss"] >= worker.last["rss"] > 50e6


def test_in_place_wants_a_gguf_file(tmp_path, capsys):
    model = tmp_path / "m"
    main(["bench", "make-model", "--shape", "tiny", "--layers", "1", "--out", str(model)])
    capsys.readouterr()
    assert main(["bench", "generate", "--model", str(model), "--in-place"]) == 2
    (line,) = [row for row in capsys.readouterr().err.splitlines() if "error" in row]
    assert "--in-place" in line and ".gguf" in line


def test_compare_llama_cpp_wants_a_gguf_file(tmp_path, capsys):
    model = tmp_path / "m"
    main(["bench", "make-model", "--shape", "tiny", "--layers", "1", "--out", str(model)])
    capsys.readouterr()
    assert main(["bench", "generate", "--model", str(model), "--compare-llama-cpp"]) == 2
    (line,) = [row for row in capsys.readouterr().err.splitlines() if "error" in row]
    assert "GGUF" in line or "llama-cpp-python" in line  # whichever is missing first


def test_a_llama_cpp_killed_on_an_amx_cpu_is_told_how_to_rebuild_it(monkeypatch):
    """llama-cpp-python's AMX kernels crash on some AMX CPUs (SIGILL or SIGSEGV at ldtilecfg): the
    error says how to build it without them, and only then."""
    from hybridmoe.bench import compare_llama_cpp as compare

    monkeypatch.setattr(compare, "cpu_flags", lambda: frozenset({"avx512f", "amx_int8"}))
    for signal in (4, 11):
        assert "-mno-amx-int8" in compare._hint("llama.cpp", -signal)
    assert compare._hint("llama.cpp", 1) == "" and compare._hint("hybridmoe", -11) == ""
    monkeypatch.setattr(compare, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert compare._hint("llama.cpp", -4) == ""


def test_the_machine_says_which_kernel_paths_ran(monkeypatch):
    """A benchmark's JSON names the integer kernels' path and the bf16 kernels' build it ran on,
    as HYBRIDMOE_QUANT_ISA and HYBRIDMOE_BF16_ISA name them."""
    from hybridmoe.bench.generate import machine
    from hybridmoe.native import bf16, quant

    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")
    monkeypatch.setenv("HYBRIDMOE_BF16_ISA", "off")
    assert (machine()["quant_path"], machine()["bf16_build"]) == ("off", "off")
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "avx2")
    monkeypatch.setenv("HYBRIDMOE_BF16_ISA", "avx2")
    want = ("avx2" if quant.isa() else "off", "avx2" if bf16.isa() else "off")
    assert (machine()["quant_path"], machine()["bf16_build"]) == want
