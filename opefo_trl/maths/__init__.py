"""Self-contained numerical kernels (pure torch, no TRL import) that the estimators build on."""
