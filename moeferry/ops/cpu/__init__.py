"""Kernels for the host CPU (the `cpu` and `hybrid` MoE backends' lane)."""
