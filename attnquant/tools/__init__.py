"""The ``attnquant`` command line and what it runs: quantize, verify, demo."""
