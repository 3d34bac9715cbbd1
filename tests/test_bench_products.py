"""`hybridmoe bench products`: each format, shape and token count measured, both results of each
product agree within the activations' and bf16's rounding, and bad input is one line, exit 2."""

from __future__ import annotations

import json

import pytest

from tests.console import hybridmoe


def test_every_product_is_measured_and_both_ways_agree():
    out = hybridmoe(
        "bench", "products", "--shapes", "48x512,16x256", "--tokens", "8,40", "--repeats", "2",
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {(r["format"], r["shape"], r["tokens"]) for r in rows} == {
        (f, s, t) for f in ("q4_k", "q8_0", "q6_k") for s in ("48x512", "16x256") for t in (8, 40)
    }
    for r in rows:
        assert r["ours_ms"] > 0 and r["onednn_ms"] > 0
        assert r["ratio"] == pytest.approx(r["onednn_ms"] / r["ours_ms"])
        # int8 activations (a step of max|x| / 127 a super-block) against bf16 weights and rows
        assert r["max_rel_diff"] < 0.03, r


def test_from_ram_each_product_takes_weights_the_caches_no_longer_hold():
    """--from-ram: every timed product reads a copy of the weights that a calibration's worth of
    others (tuning.ROTATE_BYTES, both sides' copies together) has passed since; the results agree
    as they do from the caches."""
    from hybridmoe.tuning import ROTATE_BYTES

    out = hybridmoe(
        "bench", "products", "--formats", "q4_k", "--shapes", "256x2048", "--tokens", "1,8",
        "--repeats", "3", "--from-ram", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["tokens"] for r in rows] == [1, 8]
    for r in rows:
        assert r["from_ram"] and r["weight_bytes"] == 256 * 2048 // 256 * 144
        # between two products on one copy: the side's other copies and all of the other side's
        assert (2 * r["weight_copies"] - 1) * r["weight_bytes"] >= ROTATE_BYTES
        assert r["max_rel_diff"] < 0.03, r


def test_the_formats_read_from_files_are_measured_too():
    """Q4_1 (gguf's quantiser) and Q5_K (Q4_K blocks widened by a fifth bit of 0): their products
    agree with dequantise + oneDNN as the others do."""
    out = hybridmoe(
        "bench", "products", "--formats", "q4_1,q5_k", "--shapes", "32x512", "--tokens", "4,20",
        "--repeats", "1", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {(r["format"], r["tokens"]) for r in rows} == {
        (f, t) for f in ("q4_1", "q5_k") for t in (4, 20)
    }
    assert all(r["max_rel_diff"] < 0.03 for r in rows), rows


@pytest.mark.parametrize(
    "args,names",
    [
        (("--formats", "q3_k"), "--formats"),
        (("--shapes", "12x100"), "--shapes"),
        (("--shapes", "wide"), "--shapes"),
        (("--tokens", "0"), "--tokens"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, names):
    out = hybridmoe("bench", "products", *args)
    assert out.returncode == 2 and names in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
