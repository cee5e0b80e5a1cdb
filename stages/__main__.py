"""``python -m stages``: see stages/cli.py."""

import sys

from stages.cli import main

sys.exit(main())
