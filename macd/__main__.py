"""`python -m macd`: the same as the `macd` command (launchd runs the daemon this way)."""

from .cli import main

raise SystemExit(main())
