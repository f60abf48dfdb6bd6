"""Deployment paths that are not set-up commands: the offline CUDA wheelhouse (`wheelhouse`, `lock`)."""
