"""Data: corpus sources, a cached memory-mapped token store, packing and the grain iterator."""
