"""``python -m kt_ops.bench``: MoE layer forward speed against the machine's limits."""
