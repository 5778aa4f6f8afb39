"""`python -m streamjoin COMMAND [ARGS...]`: the same as the `streamjoin` command (streamjoin.cli)."""

import sys

from streamjoin.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
