"""MAX architectures served by attnquant (one package per model family)."""
