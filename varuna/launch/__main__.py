"""``python -m varuna.launch``: the same as ``varuna-launch``."""

import sys

from varuna.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
