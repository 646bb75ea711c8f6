"""Plain-PyTorch reference implementations (the oracles the kernels and the vLLM integration are tested against)."""
