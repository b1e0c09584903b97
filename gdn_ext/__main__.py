"""``python -m gdn_ext [COMMAND] [options]``: the applications of gdn_ext.apps.

No command (or options only): train the character-level language model (``train``)."""
import difflib
import importlib
import sys

from .apps._cli import COMMANDS, commands_help, plain

USAGE = f"usage: python -m gdn_ext [{{{','.join(COMMANDS)}}}] [options]"


def _help():
    return "\n".join([USAGE, "", plain(__doc__.split("\n\n", 1)[1]), "", commands_help()])


def main(argv=None):
    """Dispatch to a command's main(argv); returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    if not argv or argv[0].startswith("-"):
        name, rest = "train", argv
    elif argv[0] in COMMANDS:
        name, rest = argv[0], argv[1:]
    else:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"{USAGE}\npython -m gdn_ext: error: unknown command '{argv[0]}'{hint}; choose from "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    module = importlib.import_module("gdn_ext.apps." + target)
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
