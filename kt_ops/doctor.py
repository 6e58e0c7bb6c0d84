"""``python -m kt_ops.doctor``: prints :func:`kt_ops.doctor`'s report.

Importing this module (``import kt_ops.doctor``) prints nothing; it makes the package's
``kt_ops.doctor`` name this module, so the module is callable as the function it shadows."""

import sys
import types

from kt_ops.diagnostics import doctor


class _CallableModule(types.ModuleType):
    def __call__(self) -> str:
        return doctor()


if __name__ == "__main__":  # as `kt-ops doctor`, with its exit statuses (141: stdout's reader left)
    from kt_ops.cli import main

    sys.exit(main(["doctor", *sys.argv[1:]]))
else:
    sys.modules[__name__].__class__ = _CallableModule
