"""Readers: linear probes and sparse autoencoders that map one hook's activations to
scores, stored by name beside the steering vectors (api.md §7).

- `kinds`: the loaded records (`LinearProbe`, `SparseAutoencoder`) and the encode math
  the engine runs on rows (`probe_scores`, `sae_encode`, `sae_top_k`, `decoder_row`).
- `formats`: probe uploads (safetensors, npz, npy, pt, JSON; scikit-learn's names).
- `sae`: SAELens's saved directories, from a tar or zip or in place.
- `registry`: one file per name under `--readers-dir`; `ReaderShape` for requests.
- `readout`: the request's `readout` field, parsed and checked (`parse_readout`).
"""
