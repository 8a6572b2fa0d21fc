"""``python -m attnquant``: the same as the ``attnquant`` command."""

from attnquant.cli import main

raise SystemExit(main())
