"""The console command: --help everywhere, generate and chat end to end, clear errors."""

import pytest

from hybridmoe.cli import COMMANDS, build_parser, main
from tests.console import hybridmoe


def subcommand_parsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


def test_every_command_is_registered():
    assert set(subcommand_parsers()) >= {c for c in COMMANDS}


@pytest.mark.parametrize("name", COMMANDS)
def test_help_on_every_subcommand(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage: hybridmoe " + name in capsys.readouterr().out


def test_generate_streams_text_and_reports_speed(tiny_chat_model):
    out = hybridmoe(
        "generate",
        "--model",
        str(tiny_chat_model),
        "--chat",
        "--prompt",
        "Hello",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert out.returncode == 0, out.stderr
    assert (
        "decode: 8 tokens" in out.stderr and "tok/s" in out.stderr
    )  # random weights never hit EOS here
    assert len(out.stdout) > 1  # the streamed text (whatever random weights say) and a newline


def test_generate_greedy_is_deterministic_and_seeded_sampling_reproducible(tiny_chat_model, capsys):
    def run(*extra):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(tiny_chat_model),
                    "--prompt",
                    "Once",
                    "--max-tokens",
                    "6",
                    *extra,
                ]
            )
            == 0
        )
        return capsys.readouterr().out

    assert run("--temperature", "0") == run("--temperature", "0")
    assert run("--temperature", "1", "--seed", "7") == run("--temperature", "1", "--seed", "7")


def test_chat_loop_answers_each_line_until_eof(tiny_chat_model):
    out = hybridmoe(
        "chat",
        "--model",
        str(tiny_chat_model),
        "--max-tokens",
        "4",
        input="Hi\n/reset\nHow are you?\n",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("> ") == 4  # three lines read, then EOF at the fourth prompt
    assert out.stderr.count("tok/s]") == 2  # two answers (the /reset line is a command)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
    ],
)
def test_bad_sampling_options_are_one_line_errors(tiny_chat_model, capsys, args, fragment):
    assert main(["generate", "--model", str(tiny_chat_model), "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "extra, beside",
    [
        ([], True),  # the CPU runtime: prefill on a second core (this machine has two or more)
        (["--threads", "1"], True),  # the same, a pass alone on one thread
        (["--device", "emulated"], False),  # the hybrid runtime keeps per-pass state
        (["--overlap-prefill", "off"], False),
    ],
)
def test_serve_puts_prefill_beside_decode_only_where_two_passes_can_run_at_once(
    tiny_chat_model, one_torch_thread, extra, beside
):
    from hybridmoe.cli.options import available_cores, load_from_args
    from hybridmoe.cli.serve import overlap_prefill

    args = build_parser().parse_args(["serve", "--model", str(tiny_chat_model), *extra])
    model, _ = load_from_args(args)
    assert overlap_prefill(args, model) == (beside and available_cores() >= 2)


def test_serve_refuses_overlap_on_where_it_cannot_run(tiny_chat_model, one_torch_thread, capsys):
    code = main(
        [
            "serve",
            "--model",
            str(tiny_chat_model),
            "--port",
            "0",
            "--device",
            "emulated",
            "--overlap-prefill",
            "on",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--overlap-prefill on needs" in err and "Traceback" not in err
