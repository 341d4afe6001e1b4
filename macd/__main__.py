"""`python -m macd`: the same as the `macd` command (launchd runs the daemon this way)."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules load: one line, as `main` says it
    print("macd: interrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
