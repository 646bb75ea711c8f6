"""A tiny random DeepSeek-V4 checkpoint that vLLM's CPU path loads.

Geometry: vocab 512, hidden 256, 4 layers [SWA, CSA (m = 4), HCA (m' = 128), CSA],
16 heads of 512 with one shared K = V head, RoPE 64, window 128, indexer
64 x 128 with top-k 512, mHC x4, 64 routed experts (top-6) + 1 shared, bf16,
plus one MTP layer (`num_nextn_predict_layers = 1`, DeepSeek-native `mtp.0.*`
names; vLLM's CPU target loader drops them, our MTP drafter reads them).
The CPU kernels pin head_dim 512, rope 64, indexer head 128, top-k 512 and
the expert counts; everything else is shrunk.

Weights are DeepSeek-native names (vLLM's mapper renames them): random normal,
linears std 1/sqrt(fan_in), embedding std 1, `ape` x0.1, mHC `fn` x0.01,
norms 1, sinks 0, router biases 0, `tid2eid` random expert ids. Same seed ->
same bytes. About 39M parameters (78 MB); building takes ~5 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512
HIDDEN = 256
HEAD_DIM = 512
ROPE_DIM = 64
N_HEADS = 16
Q_LORA = 128
O_LORA = 128
O_GROUPS = 4
WINDOW = 128
INDEX_HEADS = 64
INDEX_DIM = 128
HC = 4
N_EXPERTS = 64
TOPK_EXPERTS = 6
MOE_INTER = 128
COMPRESS_RATIOS = [0, 4, 128, 4]
DECISIVE_BIGRAM = 0.85  # the greedy suites' checkpoint: top-2 gaps far above bf16 rounding (docs/testing.md)


def config_dict(*, mtp: bool = True, num_hash_layers: int = 1, max_position_embeddings: int = 4096) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    from tiny_models import BOS_ID, EOS_ID, PAD_ID  # noqa: E402

    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": len(COMPRESS_RATIOS),
        "compress_ratios": COMPRESS_RATIOS + [0],  # trailing entry: the MTP layer (ignored)
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": Q_LORA,
        "o_lora_rank": O_LORA,
        "o_groups": O_GROUPS,
        "sliding_window": WINDOW,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": max_position_embeddings,
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_DIM,
        "index_topk": 512,
        "hc_mult": HC,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": N_EXPERTS,
        "num_experts_per_tok": TOPK_EXPERTS,
        "n_shared_experts": 1,
        "moe_intermediate_size": MOE_INTER,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "num_hash_layers": num_hash_layers,
        "swiglu_limit": 10.0,
        "num_nextn_predict_layers": 1 if mtp else 0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _block_weights(prefix: str, ratio: int, hash_layer: bool, rnd, ones, zeros) -> dict:
    """One decoder block (attention + MoE + mHC) under DeepSeek-native names."""
    import torch

    w: dict[str, torch.Tensor] = {}
    mix = (2 + HC) * HC
    for part in ("attn", "ffn"):
        w[f"{prefix}{part}_norm.weight"] = ones(HIDDEN)
        w[f"{prefix}hc_{part}_fn"] = rnd(mix, HC * HIDDEN, std=0.01, dtype=torch.float32)
        w[f"{prefix}hc_{part}_base"] = zeros(mix, dtype=torch.float32)
        w[f"{prefix}hc_{part}_scale"] = ones(3, dtype=torch.float32)
    a = f"{prefix}attn."
    w[a + "wq_a.weight"] = rnd(Q_LORA, HIDDEN)
    w[a + "wkv.weight"] = rnd(HEAD_DIM, HIDDEN)
    w[a + "q_norm.weight"] = ones(Q_LORA)
    w[a + "kv_norm.weight"] = ones(HEAD_DIM)
    w[a + "wq_b.weight"] = rnd(N_HEADS * HEAD_DIM, Q_LORA)
    w[a + "wo_a.weight"] = rnd(O_GROUPS * O_LORA, N_HEADS * HEAD_DIM // O_GROUPS)
    w[a + "wo_b.weight"] = rnd(HIDDEN, O_GROUPS * O_LORA)
    w[a + "attn_sink"] = zeros(N_HEADS, dtype=torch.float32)
    if ratio > 1:
        coff = 2 if ratio == 4 else 1
        c = a + "compressor."
        w[c + "ape"] = rnd(ratio, coff * HEAD_DIM, std=0.1, dtype=torch.float32)
        w[c + "wkv.weight"] = rnd(coff * HEAD_DIM, HIDDEN)
        w[c + "wgate.weight"] = rnd(coff * HEAD_DIM, HIDDEN)
        w[c + "norm.weight"] = ones(HEAD_DIM)
    if ratio == 4:
        i = a + "indexer."
        w[i + "wq_b.weight"] = rnd(INDEX_HEADS * INDEX_DIM, Q_LORA)
        w[i + "weights_proj.weight"] = rnd(INDEX_HEADS, HIDDEN)
        ic = i + "compressor."
        w[ic + "ape"] = rnd(4, 2 * INDEX_DIM, std=0.1, dtype=torch.float32)
        w[ic + "wkv.weight"] = rnd(2 * INDEX_DIM, HIDDEN)
        w[ic + "wgate.weight"] = rnd(2 * INDEX_DIM, HIDDEN)
        w[ic + "norm.weight"] = ones(INDEX_DIM)
    f = f"{prefix}ffn."
    w[f + "gate.weight"] = rnd(N_EXPERTS, HIDDEN)
    if hash_layer:
        w[f + "gate.tid2eid"] = torch.randint(0, N_EXPERTS, (VOCAB, TOPK_EXPERTS), dtype=torch.int32)
    else:
        w[f + "gate.bias"] = zeros(N_EXPERTS, dtype=torch.float32)
    for e in list(range(N_EXPERTS)) + ["shared"]:
        base = f + (f"experts.{e}." if e != "shared" else "shared_experts.")
        w[base + "w1.weight"] = rnd(MOE_INTER, HIDDEN)
        w[base + "w3.weight"] = rnd(MOE_INTER, HIDDEN)
        w[base + "w2.weight"] = rnd(HIDDEN, MOE_INTER)
    return w


def build_weights(seed: int = 0, *, mtp: bool = True, num_hash_layers: int = 1, head_gain: float = 1.0,
                  bigram: float = 0.0, mtp_bigram: bool = False) -> dict:
    """head_gain scales the output head (a peaked next-token distribution for sampling tests); bigram adds
    bigram * e_t / |e_t| to the head row of token perm(t) (a fixed random permutation). mtp_bigram: the MTP
    layer's input projections pass the next token's embedding through (e_proj = I, h_proj = 0), so with the
    bigram vote the MTP head predicts the target's likely successor (MTP trees get accepted); every other
    weight is unchanged."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=None, dtype=torch.bfloat16):
        s = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    def ones(*shape, dtype=torch.bfloat16):
        return torch.ones(*shape, dtype=dtype)

    def zeros(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # tid2eid
        w = {
            "embed.weight": rnd(VOCAB, HIDDEN, std=1.0),
            "head.weight": rnd(VOCAB, HIDDEN, std=head_gain * HIDDEN ** -0.5),
            "norm.weight": ones(HIDDEN),
            "hc_head_fn": rnd(HC, HC * HIDDEN, std=0.01, dtype=torch.float32),
            "hc_head_base": zeros(HC, dtype=torch.float32),
            "hc_head_scale": ones(1, dtype=torch.float32),
        }
        if bigram:
            e = w["embed.weight"].float()
            perm = torch.randperm(VOCAB, generator=g)
            head = w["head.weight"].float()
            head[perm] += bigram * e / e.norm(dim=-1, keepdim=True)
            w["head.weight"] = head.to(torch.bfloat16)
        for layer, ratio in enumerate(COMPRESS_RATIOS):
            w.update(_block_weights(f"layers.{layer}.", max(1, ratio), layer < num_hash_layers, rnd, ones, zeros))
        if mtp:
            m = "mtp.0."
            w.update(_block_weights(m, 1, False, rnd, ones, zeros))
            w[m + "enorm.weight"] = ones(HIDDEN)
            w[m + "hnorm.weight"] = ones(HIDDEN)
            w[m + "e_proj.weight"] = rnd(HIDDEN, HIDDEN)
            w[m + "h_proj.weight"] = rnd(HIDDEN, HIDDEN)
            w[m + "norm.weight"] = ones(HIDDEN)
            w[m + "hc_head_fn"] = rnd(HC, HC * HIDDEN, std=0.01, dtype=torch.float32)
            w[m + "hc_head_base"] = zeros(HC, dtype=torch.float32)
            w[m + "hc_head_scale"] = ones(1, dtype=torch.float32)
            if mtp_bigram:
                w[m + "e_proj.weight"] = torch.eye(HIDDEN, dtype=torch.bfloat16)
                w[m + "h_proj.weight"] = zeros(HIDDEN, HIDDEN)
    return {k: v.contiguous() for k, v in w.items()}


def make_tiny_dsv4(out_dir: str | Path, *, seed: int = 0, mtp: bool = True, tokenizer_dir: str | Path | None = None,
                   max_position_embeddings: int = 4096, head_gain: float = 1.0, bigram: float = 0.0,
                   mtp_bigram: bool = False) -> Path:
    """Write config.json, model.safetensors and a vocab-512 tokenizer into out_dir."""
    import shutil

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    from tiny_models import TOKENIZER_EXTRA_FILES, make_tokenizer  # noqa: E402

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(mtp=mtp, max_position_embeddings=max_position_embeddings)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(build_weights(seed, mtp=mtp, head_gain=head_gain, bigram=bigram, mtp_bigram=mtp_bigram),
              str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer_dir is None:
        make_tokenizer(out, VOCAB)
    else:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_EXTRA_FILES):
                shutil.copy2(f, out / f.name)
    return out


if __name__ == "__main__":
    print(make_tiny_dsv4(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-dsv4"))
