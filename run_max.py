#!/usr/bin/env python3
"""``python run_max.py serve|generate [max args]``: MAX with attnquant.

See ``attnquant/max_cli.py`` for what it adds; everything else goes to MAX
unchanged.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnquant.tools.max_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
