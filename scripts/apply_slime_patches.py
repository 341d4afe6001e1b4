"""Apply stoa's patches to a slime checkout, idempotently and without git.

    python scripts/apply_slime_patches.py <slime-checkout> [--check] [--patch FILE ...]

The logic (statuses, exit codes) lives in `slime_stoa.trainer.slime.patching`; see its docstring.
"""

import sys

from slime_stoa.trainer.slime.patching import main

if __name__ == "__main__":
    sys.exit(main())
