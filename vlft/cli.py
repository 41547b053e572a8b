"""What the command-line entry points share: bad input ends in one line naming the file and line, not a traceback."""

from __future__ import annotations

import sys

from vlft.errors import ConfigError, InputError


def run(main) -> None:
    try:
        main()
    except (InputError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
