"""``python -m gdn_ext [COMMAND] [options]``: the applications of gdn_ext.apps.

No command (or options only): train the character-level language model (``train``)."""
import difflib
import importlib
import sys

# command -> (module of gdn_ext.apps with a main(argv), what it does)
COMMANDS = {
    "train": ("train", "train the character-level Gated DeltaNet language model (the default)"),
    "check": ("check", "gradient check of the layer: finite differences and PyTorch autograd"),
    "demo": ("demo", "time the C forward and backward on random inputs"),
    "bench": ("bench", "gdn_ext's speed next to its peers (GFLOP/s, x peak)"),
    "bench-qwen3-next": ("bench_qwen3_next", "a small Qwen3-Next model with and without gdn_ext"),
    "ondisk": ("ondisk", "a batch larger than memory from zarr through gdn_ext.dask"),
    "conformance": ("conformance", "check a gated delta rule kernel against gdn_ext"),
}
USAGE = f"usage: python -m gdn_ext [{{{','.join(COMMANDS)}}}] [options]"


def _help():
    lines = [USAGE, "", __doc__.splitlines()[2], "", "commands:"]
    lines += [f"  {name:<18}{what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "python -m gdn_ext COMMAND --help: the options of a command"]
    return "\n".join(lines)


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
