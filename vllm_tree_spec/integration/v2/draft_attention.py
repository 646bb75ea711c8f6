"""A draft network's attention with its committed entries read in place from vLLM's pages (Model Runner V2).

The rows of one forward of an EAGLE head or a draft model (a feed's new entries, or one tree level) of request
b see two disjoint key sets:

    committed   the request's entries 0 .. P_b - 1, in the pages of the network's layer (holes masked), seen
                by every row of the forward
    own         the step's columns not in the pages: this forward's rows, the tree's earlier levels, a draft
                model's root entry that has no slot yet; small and dense [B, H_kv, W, D], visible per the
                drafter's mask (causal in a feed, ancestors in a tree level)

Each part's softmax is computed over its own keys with its log-sum-exp, and the two are merged by their
weights (`cpu_tree_split.merge`, the target's CPU split path), which is the softmax over both. The committed
part reads the pages where they are, never gathering a request's context:

    FLASH_ATTN / TRITON_ATTN pages on CUDA   the project's Triton tree kernel, every row a node that sees no
                                             tree key (so exactly the committed entries), with its log-sum-exp
    CPU_ATTN pages, CPU tensors, or holes    blockwise in PyTorch (`cpu_tree_split.prefix_part`, 64 blocks per
                                             matmul); the kernel cannot mask holes inside the committed range
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_tree_spec.drafters.head_kv import widen_cols
from vllm_tree_spec.integration.cpu_tree_split import BLOCK_CHUNK, PrefixBlocks, merge, prefix_part

SCORE_ELEMENTS = 1 << 24  # fp32 scores per row chunk of a forward (64 MiB), whatever the feed's length


@dataclass
class Committed:
    """The committed entries each row of a forward sees; shared by the network's layers.

    Entries 0 .. lengths[b] - 1 of request b are at the cache slots of positions 0 .. lengths[b] - 1 of its
    block ids (`block_table`, padded past its blocks with its first block: the kernel reads slots there and
    masks them)."""

    block_table: torch.Tensor  # [B, nblk] int32
    lengths: list[int]  # host
    block_size: int
    valid: torch.Tensor | None = None  # [B, max(lengths)] bool, False at holes (None: no holes)

    backend = "auto"  # class-wide: "triton" / "torch" force a path (tests run the kernel's on the interpreter)

    def __post_init__(self):
        self.device = self.block_table.device
        self._blocks: PrefixBlocks | None = None
        self._kernel: tuple | None = None

    def blocks(self) -> PrefixBlocks:
        """The requests' committed blocks flattened for the blockwise path (built once per forward)."""
        if self._blocks is None:
            bs, dev = self.block_size, self.device
            nblk = [-(-n // bs) for n in self.lengths]
            b = torch.repeat_interleave(torch.arange(len(nblk)), torch.tensor(nblk)).to(dev)  # [M]
            j = torch.cat([torch.arange(m) for m in nblk]).to(dev)  # block index within its request
            key_pos = j[:, None] * bs + torch.arange(bs, device=dev)  # [M, bs]
            lengths = torch.tensor(self.lengths, device=dev)
            key_valid = key_pos < lengths[b][:, None]
            if self.valid is not None:
                cols = key_pos.clamp(max=max(self.valid.shape[1] - 1, 0))
                key_valid &= self.valid[b[:, None], cols]
            self._blocks = PrefixBlocks(self.block_table[b, j].long(), b, key_pos, key_valid)
        return self._blocks

    def kernel_inputs(self, n: int) -> tuple:
        """The tree kernel's metadata for n rows per request, all nodes with no tree key visible."""
        if self._kernel is None or self._kernel[0] != n:
            batch, dev = len(self.lengths), self.device
            lengths = torch.tensor(self.lengths, dtype=torch.int32, device=dev)
            starts = torch.arange(batch + 1, dtype=torch.int32, device=dev) * n  # query rows = nodes
            packed = torch.zeros(batch * n, -(-n // 32), dtype=torch.int32, device=dev)  # no ancestor, not even self
            self._kernel = (n, lengths + n, starts, packed, max(self.lengths) + n)
            need = -(-self._kernel[4] // self.block_size)  # the rows' own slots are read (and masked) too
            if self.block_table.shape[1] < need:
                pad = self.block_table[:, :1].expand(-1, need - self.block_table.shape[1])
                self.block_table = torch.cat([self.block_table, pad], 1).contiguous()
        return self._kernel[1:]

    def attend(self, q: torch.Tensor, cache: torch.Tensor, layout: str, isa, scale: float,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, n, H, D] over the committed entries of one layer's cache: (o [B, n, H, D] fp32, 0 where no
        entry is visible; lse [B, n, H] fp32, -inf there). backend "auto": the kernel for a CUDA FLASH_ATTN /
        TRITON_ATTN cache without holes, else blockwise ("triton" / "torch" force one, for tests)."""
        bsz, n, heads, d = q.shape
        backend = backend or self.backend
        if backend == "auto":
            backend = "triton" if layout == "paged" and q.is_cuda and self.valid is None else "torch"
        if backend == "triton":
            if layout != "paged" or self.valid is not None:
                raise ValueError("the tree kernel reads FLASH_ATTN / TRITON_ATTN pages without holes only")
            return self._attend_kernel(q, cache, scale)
        hkv = cache.shape[1]
        qf = q.float().view(bsz, n, hkv, heads // hkv, d)
        lse, o = prefix_part(qf, cache, d, self.blocks(), None, isa=isa, scale=scale, softcap=0.0, window=0,
                             values=True, layout=layout)
        return o.reshape(bsz, n, heads, d), lse.reshape(bsz, n, heads)

    def _attend_kernel(self, q: torch.Tensor, cache: torch.Tensor, scale: float):
        from vllm_tree_spec.tree_attention import tree_attention

        bsz, n, heads, d = q.shape
        seq_lens, starts, packed, max_seq = self.kernel_inputs(n)
        key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)  # [nb, bs, Hkv, D] views
        lse = torch.empty(bsz * n, heads, dtype=torch.float32, device=q.device)
        o = tree_attention(q.reshape(bsz * n, heads, d).to(cache.dtype).contiguous(), key_cache, value_cache,
                           self.block_table, seq_lens, starts, starts, packed, None, scale=scale, backend="triton",
                           lse_out=lse, max_query_len=n, max_seq_len=max_seq)
        lse = lse.view(bsz, n, heads)
        o = torch.where(torch.isfinite(lse)[..., None], o.view(bsz, n, heads, d).float(), 0.0)
        return o, lse


class PagedLayerKV:
    """One layer's keys for a forward: the committed entries in the layer's pages and the step's own columns
    [B, H_kv, W, D] (`k`, `v`; the forward writes its rows' K/V there)."""

    def __init__(self, committed: Committed, cache: torch.Tensor, layout: str, isa, k: torch.Tensor,
                 v: torch.Tensor):
        self.committed, self.cache, self.layout, self.isa = committed, cache, layout, isa
        self.k, self.v = k, v

    def widen(self, cols: int) -> None:
        """Room for `cols` own columns (content kept)."""
        if self.k.shape[2] < cols:
            self.k, self.v = widen_cols(self.k, cols), widen_cols(self.v, cols)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, cols: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """q [B, n, H, D], k / v [B, n, Hkv, D] (roped) written at own columns cols [B, n]; mask [B, n, W] over
        the own columns. Returns [B, n, H * D] in q's dtype (module docstring). Rows go in chunks that bound
        the score temporaries (a feed may bring a whole prefill chunk)."""
        bsz, n, heads, d = q.shape
        scale = d ** -0.5 if scale is None else scale
        b = torch.arange(bsz, device=q.device)[:, None]
        self.k[b, :, cols] = k.to(self.k.dtype)
        self.v[b, :, cols] = v.to(self.v.dtype)
        keys = max(mask.shape[-1], BLOCK_CHUNK * self.committed.block_size)
        rows = max(1, SCORE_ELEMENTS // (bsz * heads * keys))
        out = torch.empty(bsz, n, heads, d, dtype=q.dtype, device=q.device)
        for r0 in range(0, n, rows):
            out[:, r0: r0 + rows] = self._rows(q[:, r0: r0 + rows], mask[:, r0: r0 + rows], scale)
        return out.reshape(bsz, n, heads * d)

    def _rows(self, q: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        bsz, n, heads, d = q.shape
        hkv, w = self.k.shape[1], mask.shape[-1]
        qf = q.float().view(bsz, n, hkv, heads // hkv, d)
        s = torch.einsum("bikgd,bkjd->bikgj", qf, self.k[:, :, :w].float()) * scale  # [B, n, Hkv, G, W]
        s = s.masked_fill(~mask[:, :, None, None, :], -math.inf)
        lse_own = torch.logsumexp(s, dim=-1)  # finite: every row sees itself
        o_own = torch.einsum("bikgj,bkjd->bikgd", torch.exp(s - lse_own[..., None]), self.v[:, :, :w].float())
        if max(self.committed.lengths, default=0) > 0:
            o_c, lse_c = self.committed.attend(q, self.cache, self.layout, self.isa, scale)
            o_own = merge(o_c.view_as(o_own), lse_c.view_as(lse_own), o_own, lse_own, None, kernel_prefix=False)
        return o_own.reshape(bsz, n, heads, d).to(q.dtype)


class PagedStep(list):
    """A forward's per-layer `PagedLayerKV` (the head indexes it by layer, as a dense store's per-layer K/V)."""

    def widen(self, cols: int) -> None:
        for layer in self:
            layer.widen(cols)
