"""Backward stages of chunked KDA, chained by `chunk_bwd`."""
