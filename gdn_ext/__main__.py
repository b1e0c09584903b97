"""``python -m gdn_ext [check | demo] [options]``.

No command: train the character-level Gated DeltaNet language model (gdn_ext.train).
``check``: gradient check of the layer (gdn_ext.check). ``demo``: kernel timing (gdn_ext.demo).
"""
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "check":
        from .check import main as run
        return run(argv[1:])
    if argv and argv[0] == "demo":
        from .demo import main as run
        return run(argv[1:])
    from .train import main as run
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
