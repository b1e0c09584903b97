"""What the command-line applications share: the list of commands, argparse ``type=`` callables
that turn a bad value into a usage error (not a traceback), the help formatter that shows every
option's default, and `plain`, which turns a module docstring's reST markup into the plain text
that ``--help`` shows (the docstrings stay reST for the API reference)."""
import argparse
import copy
import inspect
import math
import re

# command -> (module of gdn_ext.apps with build_parser() and main(argv), what it does)
COMMANDS = {
    "train": ("train", "train the character-level Gated DeltaNet language model (the default)"),
    "check": ("check", "gradient check of the layer: finite differences and PyTorch autograd"),
    "demo": ("demo", "time the C forward and backward on random inputs"),
    "bench": ("bench", "gdn_ext's speed next to its peers (GFLOP/s, x peak)"),
    "bench-qwen3-next": ("bench_qwen3_next", "a small Qwen3-Next model with and without gdn_ext"),
    "ondisk": ("ondisk", "a batch larger than memory from zarr through gdn_ext.dask"),
    "conformance": ("conformance", "check a gated delta rule kernel against gdn_ext"),
}


def commands_help():
    """The "commands:" block of ``python -m gdn_ext --help`` and of the train command's epilog."""
    lines = ["commands:"]
    lines += [f"  {name:<18}{what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "python -m gdn_ext COMMAND --help: the options of a command"]
    return "\n".join(lines)


def positive_int(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def non_negative_int(text):
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return n


def positive_float(text):
    x = float(text)
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return x


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line layout, and ends each option's help with its
    default: "(default: off)" for a flag, the value as it would be typed for the others (a list
    as space-separated words). An option whose help already says "default" keeps its own words
    (for a default computed at run time, or None, which has no value to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS):
            return text
        if not action.option_strings:          # positionals: no default to speak of
            return text
        if action.default is False and action.nargs == 0:
            return text + " (default: off)"
        return text + " (default: %(default)s)"

    def _expand_help(self, action):
        if isinstance(action.default, (list, tuple)):
            action = copy.copy(action)
            action.default = " ".join(str(d) for d in action.default)
        return super()._expand_help(action)


def add_shape(ap, batch, seq_len, head_dim, heads=4):
    """The problem-shape options that bench, demo and ondisk share: --batch, --seq-len,
    --heads, --head-dim, with these defaults."""
    ap.add_argument("--batch", type=positive_int, default=batch, help="B, sequences")
    ap.add_argument("--seq-len", type=positive_int, default=seq_len, help="T, tokens")
    ap.add_argument("--heads", type=positive_int, default=heads, help="H, heads")
    ap.add_argument("--head-dim", type=positive_int, default=head_dim,
                    help="Dk = Dv, the head size")


def parser(prog, doc, **kwargs):
    """An ArgumentParser whose description is the plain text of the docstring doc."""
    return argparse.ArgumentParser(prog=prog, description=plain(doc),
                                   formatter_class=HelpFormatter, **kwargs)


# reST inline markup, one alternative per kind; one pass over the text so that a literal's content
# (say ``*args``) is not read as markup again. Start strings follow whitespace or punctuation and
# end strings precede it, as in reST, so "7 * Dk * Dv" and "a*b" stay as they are.
_SPAN = r"(?:[^\n]|\n(?![ \t]*\n))"        # any text within one paragraph
_TICKED = r"(?:[^`\n]|\n(?![ \t]*\n))"     # the same without backquotes
_STARLESS = r"(?:[^*\n]|\n(?![ \t]*\n))"   # the same without stars
_INLINE = re.compile(
    r"(?<![\w\\`])(?:"
    rf"``(?P<literal>\S(?:{_SPAN}*?\S)??)``"                   # ``literal``
    rf"|(?::[\w.+-]+)+:`(?P<target>{_TICKED}+)`"              # :func:`x`, :py:mod:`~a.b`
    rf"|`(?P<link>{_TICKED}+)`__?"                             # `text <url>`_
    rf"|`(?P<interpreted>[^`\s](?:{_TICKED}*?[^`\s])??)`"      # `default role`
    rf"|\*\*(?P<strong>\S(?:{_SPAN}*?\S)??)\*\*"               # **strong**
    rf"|\*(?P<emphasis>[^*\s](?:{_STARLESS}*?[^*\s])??)\*"      # *emphasis*
    r"|(?P<footnote>\[(?:\d+|#\w*|\*)\])_"                    # [1]_
    r")(?![\w`*])")
_TITLE_TARGET = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


def _replace(m):
    kind = "target" if m["target"] is not None else m.lastgroup
    text = m[kind]
    if kind == "target":                                   # a cross-reference role
        titled = _TITLE_TARGET.match(text)
        if titled and titled["title"]:
            return titled["title"]
        text = text.lstrip("!")
        if text.startswith("~"):                           # ~a.b.c shows as c
            text = text[1:].rsplit(".", 1)[-1]
        return text
    if kind == "link":
        titled = _TITLE_TARGET.match(text)
        if titled and titled["title"]:
            return f"{titled['title']} ({titled['target']})"
        return text
    return text


def plain(doc):
    """Plain text of a reST docstring, for a terminal: inline markup without its marks
    (``x`` -> x; :func:`x`, :mod:`x`, `x` -> x; :func:`~a.b.x` -> x; :func:`title <a.b>` ->
    title; `text <url>`_ -> text (url); **x**, *x* -> x; [1]_ -> [1]) and literal-block markers
    ("text::" -> "text:"; a lone "::" line goes). The line layout and indentation are kept, so
    literal blocks and lists read as written. None (a docstring stripped by ``python -OO``)
    gives ""."""
    if not doc:
        return ""
    text = _INLINE.sub(_replace, inspect.cleandoc(doc))
    lines = []
    for line in text.split("\n"):
        if line.strip() == "::":
            continue
        if line.endswith("::"):
            line = line[:-2].rstrip() if line[:-2].endswith((" ", "\t")) else line[:-1]
        lines.append(line)
    # a dropped "::" line leaves two blank lines: keep one
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
