"""``python -m trainloom``: the ``trainloom`` command (see :mod:`trainloom.cli`)."""

import sys

from trainloom.cli import main

sys.exit(main())
