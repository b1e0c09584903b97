"""``python -m gdn_ext [COMMAND] [options]``: the applications of gdn_ext.apps.

No command (or options only): train the character-level language model (``train``)."""
import difflib
import importlib
import sys

# the applications are loaded by name, as the commands are below: no import statement of the
# library names them (tests/test_package.py keeps the library and the applications apart)
_cli = importlib.import_module("gdn_ext.apps._cli")
COMMANDS = _cli.COMMANDS
USAGE = f"usage: python -m gdn_ext [{{{','.join(COMMANDS)}}}] [options]"


def _help():
    return "\n".join([USAGE, "", _cli.plain((__doc__ or "").partition("\n\n")[2]), "",
                      _cli.commands_help()])


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
