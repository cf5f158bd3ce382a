"""The torch reference backend, the format quantizers and the oracle. Pure torch: runs anywhere."""
