"""`python -m slime_stoa.cli ...` is `stoa ...`."""

import sys

from . import main

sys.exit(main())
