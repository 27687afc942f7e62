"""Forward stages of chunked KDA: `chunk_fwd` chains `intra` (gate, L2 norm, chunk-local solve) and `state`
(inter-chunk recurrence, with the output fused in or by `output`)."""
