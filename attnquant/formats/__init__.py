"""Pure torch, no MAX: the Gemma projection vocabulary, the NVFP4 format, theta."""
