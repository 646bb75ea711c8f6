"""vllm-tree-spec: lossless tree-based speculative decoding for vLLM.

Importing the package is free of side effects: it imports neither vLLM, torch
nor Triton. vLLM loads the plugin through the `vllm.general_plugins` entry
point (`vllm_tree_spec.plugin:register`).
"""

__version__ = "0.1.0"
