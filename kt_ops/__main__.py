"""``python -m kt_ops``: the ``kt-ops`` command (:mod:`kt_ops.cli`)."""

import sys

from kt_ops.cli import main

sys.exit(main())
