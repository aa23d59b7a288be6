"""``python -m kvd``: the same as the ``kvd`` command."""

import sys

from kvd.cli import main

if __name__ == "__main__":
    sys.exit(main())
