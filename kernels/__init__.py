"""Triton kernels and their torch references (installed as `longctx.kernels`)."""
