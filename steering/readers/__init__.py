"""Readers: linear probes and sparse autoencoders that map one hook's activations to
scores, stored by name beside the steering vectors (api.md §7)."""
