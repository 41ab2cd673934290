# Imports stay under the guard: spawned workers import this module as __mp_main__, and
# must not import torch before worker.py has tied their life to the launcher's.
if __name__ == "__main__":
    import sys

    from gridtrain.cli.parser import main

    sys.exit(main())
