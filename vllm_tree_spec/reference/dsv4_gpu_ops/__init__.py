"""Plain-PyTorch references for the CUDA-only ops of vLLM 0.32's NVIDIA DeepSeek-V4 path.

Each module reproduces one op family's input/output contract (shapes, dtypes, index formats, -1 holes,
length caps, sinks, the FP8 cache bytes with their scales and page padding, in-place outputs) so that
vLLM's NVIDIA model can run on a CPU (emulated; tests/integration_dsv4_nvidia) and so that a GPU run can
check the real kernels against them. No module imports vLLM.

    layout                 fp8_ds_mla rows (584 B: 448 e4m3 + 64 bf16 + 8 UE8M0), 576-aligned pages, indexer keys
    rope                   GPT-J RoPE from vLLM's float32 cos_sin_cache
    flashmla               FlashMLA sparse decode / prefill, the tile-scheduler plan and its reuse rule
    qnorm_rope_kv_insert   fused q RMSNorm + RoPE, window-KV RoPE + FP8 quantization + paged insert
    compressor             partial-state save; compress -> RMSNorm -> RoPE -> quantize -> store (C4 / C128 / indexer)
    indexer                DeepGEMM paged MQA logits + schedule, prefill MQA logits, key gather, top-k kernels
    o_proj                 inverse RoPE + FP8 quantization of the attention output, DeepGEMM grouped FP8 einsum (wo_a)
    mhc                    TileLang mHC pre / broadcast pre / post / fused post-pre / head
"""
