"""DeepSeek-V4 model configuration for the reference model (HF field names).

The reference model reads the attention-relevant subset of a DeepSeek-V4
`config.json` under the Hugging Face field names, so a real config can be
loaded with `DSV4Config.from_hf(json.load(f))`. Fields the reference does not
model (MoE routing, mHC, quantisation, YaRN `rope_scaling`) are ignored.

Layer types come from `compress_ratios`, exactly as vLLM derives them
(`compress_ratio = max(1, compress_ratios[layer])`):

    ratio 1 (or 0)   SWA   sliding-window attention only
    ratio 4          CSA   overlapped compressor (windows of 2m, stride m) + lightning indexer top-k
    ratio m' > 1     HCA   non-overlapping compressor, every visible entry attended (m' = 128 in V4-Flash)

Every layer, CSA and HCA included, also attends to its sliding window.
`compress_ratios` may carry one more entry than `num_hidden_layers` (the MTP
layer in the released configs); entries past the last layer are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

CSA_RATIO = 4  # the only ratio with an overlapped compressor and an indexer

LayerKind = Literal["swa", "csa", "hca"]


@dataclass(frozen=True)
class DSV4Config:
    """Attention-relevant DeepSeek-V4 fields; defaults are the tiny test model.

    The tiny defaults (docs/reference-model.md): layers [SWA, CSA, HCA,
    CSA], window 8, CSA m = 4, HCA m' = 8 (so depth-8 trees cross HCA
    boundaries), and an indexer top-k of 2 so top-k really selects once a
    request holds more than 2 CSA entries (8 tokens).
    """

    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 1  # one shared K = V head (MQA); anything else is rejected
    head_dim: int = 16  # c: width of the shared K = V vector and of each query head
    qk_rope_head_dim: int = 8  # r: RoPE on the last r dims (interleaved pairs)
    q_lora_rank: int = 16
    o_groups: int = 2
    o_lora_rank: int = 16
    sliding_window: int = 8  # W, window includes the current token
    compress_ratios: tuple[int, ...] = (0, 4, 8, 4)
    index_n_heads: int = 2
    index_head_dim: int = 16  # c_I
    index_topk: int = 2
    intermediate_size: int = 64  # dense SwiGLU MLP standing in for the MoE
    rope_theta: float = 10000.0  # SWA-only layers
    compress_rope_theta: float = 160000.0  # CSA/HCA layers (q, window k, compressed k, indexer)
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        problems = []
        if self.num_key_value_heads != 1:
            problems.append(f"num_key_value_heads = {self.num_key_value_heads}: DeepSeek-V4 has one shared K = V head")
        if len(self.compress_ratios) < self.num_hidden_layers:
            problems.append(
                f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} layers"
            )
        if any(r < 0 for r in self.compress_ratios):
            problems.append(f"compress_ratios {self.compress_ratios} has a negative ratio")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            problems.append(
                f"qk_rope_head_dim = {self.qk_rope_head_dim} must be even and <= head_dim ({self.head_dim}) "
                f"and index_head_dim ({self.index_head_dim})"
            )
        if self.num_attention_heads % self.o_groups:
            problems.append(f"num_attention_heads = {self.num_attention_heads} is not divisible by o_groups")
        if self.sliding_window < 1 or self.index_topk < 1:
            problems.append("sliding_window and index_topk must be >= 1")
        if problems:
            raise ValueError("invalid DSV4Config: " + "; ".join(problems))

    # -- layer types ---------------------------------------------------------

    def compress_ratio(self, layer: int) -> int:
        """m of a layer (1 = no compressor), as vLLM computes it."""
        return max(1, self.compress_ratios[layer])

    def layer_kind(self, layer: int) -> LayerKind:
        m = self.compress_ratio(layer)
        return "swa" if m == 1 else "csa" if m == CSA_RATIO else "hca"

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta if self.layer_kind(layer) == "swa" else self.compress_rope_theta

    @property
    def ratios(self) -> tuple[int, ...]:
        """Distinct compress ratios > 1 used by the model's layers, ascending."""
        return tuple(sorted({self.compress_ratio(i) for i in range(self.num_hidden_layers)} - {1}))

    # -- loading -------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> "DSV4Config":
        """Build from a HF `config.json` dict, keeping only the fields modelled here."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def deepseek_v4_flash(cls) -> "DSV4Config":
        """DeepSeek-V4-Flash attention geometry (the public DeepSeek-V4-Flash config.json values).

        43 layers: 2 SWA-only, 21 CSA (m = 4), 20 HCA (m' = 128); the 44th ratio
        belongs to the MTP layer. MoE/mHC fields are not modelled, so
        `intermediate_size` is a placeholder; use this for accounting, not to
        instantiate weights on a CPU.
        """
        return cls(
            vocab_size=129280,
            hidden_size=4096,
            num_hidden_layers=43,
            num_attention_heads=64,
            head_dim=512,
            qk_rope_head_dim=64,
            q_lora_rank=1024,
            o_groups=8,
            o_lora_rank=1024,
            sliding_window=128,
            compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
            index_n_heads=64,
            index_head_dim=128,
            index_topk=512,
            intermediate_size=2048,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
        )
