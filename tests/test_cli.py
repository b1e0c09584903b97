"""The command line's help: every option of every ``python -m gdn_ext COMMAND`` says what it does
and what its default is, no help shows reST markup, and the command lists name every command."""
import argparse
import re
import sys

import pytest

from gdn_ext.__main__ import COMMANDS, main

MARKUP = re.compile(r"``|:\w+:`|::$", re.MULTILINE)   # literals, roles, literal-block markers


class _Captured(Exception):
    pass


def parser_of(name, monkeypatch):
    """The parser that ``python -m gdn_ext NAME`` parses its arguments with, taken from the
    command's own main() (nothing runs: parse_args is stopped)."""
    got = []

    def stop(self, *args, **kwargs):
        got.append(self)
        raise _Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Captured):
        main([name, "--help"])
    monkeypatch.undo()
    return got[0]


def help_of(argv, capsys):
    """What ``python -m gdn_ext ARGV`` prints for --help."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    assert status in (0, None)
    return capsys.readouterr().out


def option_help(parser, action):
    """The help text shown for one option, whitespace collapsed (argparse wraps it)."""
    formatter = parser._get_formatter()        # the parser's own formatter class, as --help uses
    formatter.add_argument(action)
    text = formatter.format_help()
    return " ".join(text.split())


def options(parser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def shown(default):
    """A default as the user would type it."""
    if isinstance(default, (list, tuple)):
        return " ".join(str(d) for d in default)
    return str(default)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help(name, monkeypatch):
    parser = parser_of(name, monkeypatch)
    missing = [a.dest for a in options(parser) if not (a.help or "").strip()]
    assert not missing, f"{name}: options without help: {missing}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_shows_its_default(name, monkeypatch):
    parser = parser_of(name, monkeypatch)
    for action in options(parser):
        if not action.option_strings:
            continue                                # a positional argument has no default
        text = option_help(parser, action)
        flag = action.option_strings[-1]
        # a flag says it is off, an option without a value says what happens without it
        assert "default" in text, f"{name} {flag}: help does not give the default: {text!r}"
        assert "default: None" not in text, f"{name} {flag}: {text!r}"
        if action.default not in (None, False):
            assert shown(action.default) in text, \
                f"{name} {flag}: default {action.default!r} not shown in {text!r}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_has_no_rest_markup(name, capsys):
    text = help_of([name, "--help"], capsys)
    assert "usage: python -m gdn_ext" in text
    assert not MARKUP.findall(text), f"{name} --help shows reST markup: {MARKUP.findall(text)}"


def test_top_level_help_lists_every_command_without_markup(capsys):
    text = help_of(["--help"], capsys)
    assert not MARKUP.findall(text), MARKUP.findall(text)
    for name in COMMANDS:
        assert re.search(rf"^  {re.escape(name)} ", text, re.MULTILINE), name


@pytest.mark.parametrize("argv", [["train", "--help"], ["--no-progress", "--help"]])
def test_train_help_lists_every_command(argv, capsys):
    text = help_of(argv, capsys)
    assert "--steps" in text                        # it is the train command's help
    for name in COMMANDS:
        assert re.search(rf"^  {re.escape(name)} ", text, re.MULTILINE), name


def test_bench_qwen3_next_help_needs_no_torch(monkeypatch, capsys):
    """The help of a command that needs torch and transformers to run shows without them."""
    monkeypatch.setitem(sys.modules, "torch", None)          # import torch raises ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert "--seq-len" in help_of(["bench-qwen3-next", "--help"], capsys)


def test_bad_values_are_usage_errors(capsys):
    """A count below one is refused with argparse's usage error, naming the option."""
    for argv in (["bench", "--repeat", "0"], ["bench-qwen3-next", "--batch", "0"],
                 ["train", "--seed", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert f"argument {argv[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("rest, want", [
    ("``python -m gdn_ext``: trains", "python -m gdn_ext: trains"),
    (":func:`gdn_ext.gated_delta_rule` and :mod:`gdn_ext.dask`",
     "gdn_ext.gated_delta_rule and gdn_ext.dask"),
    (":func:`~gdn_ext.torch.patch_transformers`", "patch_transformers"),
    (":py:class:`the named tuple <gdn_ext.GatedDeltaRuleOutput>`", "the named tuple"),
    ("`Gated DeltaNet <https://arxiv.org/abs/2412.06464>`_", "Gated DeltaNet (https://arxiv.org/abs/2412.06464)"),
    ("the `beta` argument, **not** *alpha*", "the beta argument, not alpha"),
    ("``*args`` and ``**kwargs``", "*args and **kwargs"),
    ("7 * Dk * Dv operations, a*b, 2**n", "7 * Dk * Dv operations, a*b, 2**n"),
    ("a ``long\nliteral`` over two lines", "a long\nliteral over two lines"),
    ("see [1]_", "see [1]"),
    ("from the command line::\n\n    python -m gdn_ext check\nmore",
     "from the command line:\n\n    python -m gdn_ext check\nmore"),
    ("run it ::\n\n    python -m gdn_ext\nmore", "run it\n\n    python -m gdn_ext\nmore"),
    ("First.\n\n::\n\n    code\nmore", "First.\n\n    code\nmore"),
    ("no markup: MODULE:FUNCTION, 10 %, x::y inside", "no markup: MODULE:FUNCTION, 10 %, x::y inside"),
    (None, ""),
])
def test_plain(rest, want):
    from gdn_ext.apps._cli import plain
    assert plain(rest) == want
