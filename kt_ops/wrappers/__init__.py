"""kt-kernel-compatible wrappers (KTMoEWrapper) and nn.Module MoE layers live here."""
