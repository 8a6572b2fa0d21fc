"""``python -m attnquant``: the same as the ``attnquant`` command."""

from attnquant.tools.cli import main

raise SystemExit(main())
