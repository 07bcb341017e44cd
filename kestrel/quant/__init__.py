"""Low-precision number formats: FP8 (e4m3), e2m1 (FP4) with NVFP4 (e4m3 scale per 16) and MXFP4 (e8m0 per 32)."""
