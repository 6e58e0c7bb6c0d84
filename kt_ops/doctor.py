"""``python -m kt_ops.doctor``: prints :func:`kt_ops.doctor`'s report."""

from kt_ops.diagnostics import doctor

print(doctor())
