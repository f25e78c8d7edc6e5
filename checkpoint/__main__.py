"""`python -m elastic.checkpoint DIR`: see checkpoint/cli.py."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
