"""``python -m refusion.eval ARGS`` = ``refusion eval ARGS``; the form ``accelerate launch -m refusion.eval``
needs (one process per GPU, the harness strides documents over them)."""

import sys

from refusion.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
