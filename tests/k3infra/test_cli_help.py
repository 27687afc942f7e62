"""Every option of `k3infra` and `agentenv` has help text; `--version` works; errors are one line, exit code 2."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from agentenv import cli as agentenv_cli
from k3infra import cli as k3infra_cli

PARSERS = {"k3infra": k3infra_cli.build_parser, "agentenv": agentenv_cli.build_parser}


def walk(parser: argparse.ArgumentParser, path: str):
    """Yield ``(command path, action)`` for every argument of `parser` and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, f"{path} {name}")
        else:
            yield path, action


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_option_has_help(prog):
    missing = [f"{path}: {'/'.join(a.option_strings) or a.dest}" for path, a in walk(PARSERS[prog](), prog)
               if not (a.help and a.help.strip()) and a.help != argparse.SUPPRESS]
    assert missing == []


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_subcommand_has_help(prog):
    def subcommands(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in action._choices_actions}
                for name, child in action.choices.items():
                    yield f"{path} {name}", helps.get(name)
                    yield from subcommands(child, f"{path} {name}")

    assert [p for p, h in subcommands(PARSERS[prog](), prog) if not h] == []


def test_walk_finds_an_option_without_help():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers().add_parser("x", help="x")
    sub.add_argument("--bare")
    assert [a.dest for _, a in walk(parser, "p") if not a.help] == ["bare"]


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_version(prog, capsys):
    module = k3infra_cli if prog == "k3infra" else agentenv_cli
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("k3-infra ")


def test_k3infra_error_is_one_line_with_exit_code_2():
    run = subprocess.run([sys.executable, "-m", "k3infra.cli", "bench", "nosuch"], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().count("\n") == 0 and "nosuch" in run.stderr


def test_agentenv_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    argv = [sys.executable, "-m", "agentenv.cli", "--home", str(tmp_path / "home"), "image", "build", "x",
            "--from", str(tmp_path / "missing")]
    run = subprocess.run(argv, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "missing" in run.stderr
    run = subprocess.run(argv[:3] + ["--debug"] + argv[3:], capture_output=True, text=True)
    assert run.returncode != 0 and "Traceback" in run.stderr


RUNNERS = ["benchmarks.kda.run", "benchmarks.kda.train", "benchmarks.kda.calibrate", "benchmarks.kda.decode",
           "benchmarks.kda.dispatch_bench", "benchmarks.ep.run", "benchmarks.ep.local", "benchmarks.env.run",
           "benchmarks.env.rl", "benchmarks.env.server", "benchmarks.env.soak", "benchmarks.env.http_fuzz",
           "benchmarks.smoke.run", "benchmarks.table"]


class _Parsed(Exception):
    """Raised in place of parsing, once a runner's parser is built."""


@pytest.mark.parametrize("module", RUNNERS)
def test_every_benchmark_runner_option_has_help(module, monkeypatch):
    import importlib

    built: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):
        built.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    main = importlib.import_module(module).main
    with pytest.raises(_Parsed):
        main([]) if main.__code__.co_argcount else main()
    assert [a.option_strings or a.dest for _, a in walk(built[0], module) if not a.help] == []
