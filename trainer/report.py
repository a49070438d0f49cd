"""`python -m trainer.report PATH...`: the sweep report's command under the name it was first given, the same as
`python -m trainer.observability.report` (kept so that commands and configs written for it still run)."""

from __future__ import annotations

import sys

from trainer.observability.report import SweepReport, main

__all__ = ["SweepReport", "main"]

if __name__ == "__main__":
    sys.exit(main())
