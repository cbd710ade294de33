"""``python -m gpattn.cli``: the ``gpattn`` command."""

from . import main

raise SystemExit(main())
