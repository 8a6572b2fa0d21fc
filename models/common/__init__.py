"""What our Gemma 3 and Gemma 4 share: the gated MLP, the attention tail, the
capture buffer ABI of their inputs, the tokenizer checks, image requests on
a server whose vision tower cannot run, and the load-time preparation."""
