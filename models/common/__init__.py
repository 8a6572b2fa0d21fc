"""What our Gemma 3 and Gemma 4 share: the gated MLP, the attention tail and
the capture buffer ABI of their inputs."""
