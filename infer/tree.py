"""`python -m infer.tree`: the earlier name of `python -m infer.search_tree` (kept working)."""

import sys

from infer.search_tree import main

if __name__ == "__main__":
    sys.exit(main())
