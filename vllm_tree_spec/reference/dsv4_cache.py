"""Decode state of the DeepSeek-V4 reference model: persistent cache and per-step scratch.

The persistent cache is organised like vLLM's: every store is addressed by
position, nothing is a running accumulator (docs/reference-model.md).
Per layer and request:

    kv            [S, c]        window K = V row of every token (RMSNorm + RoPE at its position)
    state_kv      [S, coff*c]   compressor value row C_j of every token         (CSA, HCA)
    state_score   [S, coff*c]   compressor gate row Z_j + ape[j % m]            (CSA, HCA)
    entries       [S // m, c]   compressed entry kC_w, written when token (w+1)m-1 is computed
    idx_state_kv  [S, 2*c_I]    indexer compressor rows                          (CSA)
    idx_state_score
    idx_keys      [S // 4, c_I] indexer key KI_w, same rule as entries           (CSA)

with coff = 2 for CSA (a/b halves) and 1 for HCA. Rows are kept for the whole
history up to `max_len` S instead of the live window (vLLM frees blocks behind
the window); `live_rows` gives the part a real engine must keep.

`lengths[b]` is the number of tokens of request b whose rows are in the cache
(vLLM's num_computed_tokens). Rows at positions >= lengths[b] are garbage by
design: the linear path overwrites them before anything reads them, the tree
path never reads them. `poison_uncommitted` fills them with NaN so tests prove
the second claim.

Scratch holds the same per-token rows for the R query rows of one forward
(rows [R, width]) plus one entry slot per row ([R, width], used only by rows
whose position completes a block), so every tree node owns its own rows and
its own branch-specific entries.

Slot ids. Every read and write goes through one *virtual slot* space per
buffer kind, so a single gather can mix committed rows and scratch rows:

    [0, B * S)              persistent per-token row (b, p) -> b * S + p
    [B * S, B * S + R)      scratch row r
    PAD_SLOT = -1           nothing (masked out)

and likewise for entries of ratio m with B * (S // m) persistent slots. This
mirrors vLLM, whose sparse kernels take explicit per-query slot lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from vllm_tree_spec.reference.dsv4_config import CSA_RATIO, DSV4Config

PAD_SLOT = -1


# ---------------------------------------------------------------------------
# Buffer layout (single source of truth for allocation and byte accounting)


@dataclass(frozen=True)
class BufferSpec:
    """One state buffer of one layer.

    per = "token": one row per position; per = "entry": one row per ratio-m block.
    """

    width: int
    per: Literal["token", "entry"]
    ratio: int = 1


def buffer_layout(config: DSV4Config, layer: int) -> dict[str, BufferSpec]:
    """Buffers of a layer, by name, in a fixed order."""
    c, ci = config.head_dim, config.index_head_dim
    m = config.compress_ratio(layer)
    kind = config.layer_kind(layer)
    specs = {"kv": BufferSpec(c, "token")}
    if kind != "swa":
        coff = 2 if kind == "csa" else 1
        specs["state_kv"] = BufferSpec(coff * c, "token")
        specs["state_score"] = BufferSpec(coff * c, "token")
        specs["entries"] = BufferSpec(c, "entry", m)
    if kind == "csa":
        specs["idx_state_kv"] = BufferSpec(2 * ci, "token")
        specs["idx_state_score"] = BufferSpec(2 * ci, "token")
        specs["idx_keys"] = BufferSpec(ci, "entry", CSA_RATIO)
    return specs


def live_rows(config: DSV4Config, layer: int, name: str, context_len: int) -> int:
    """Rows of a buffer a real engine keeps for one request at `context_len` tokens.

    Window KV: the last W rows; compressor state: the last coff * m rows (the
    next pooling window, vLLM's `SlidingWindowMLASpec(window = coff * r)`);
    entries / indexer keys: one per completed block.
    """
    spec = buffer_layout(config, layer)[name]
    if spec.per == "entry":
        return context_len // spec.ratio
    if name == "kv":
        return min(context_len, config.sliding_window)
    if name.startswith("idx_state"):
        return min(context_len, 2 * CSA_RATIO)
    coff = 2 if config.layer_kind(layer) == "csa" else 1
    return min(context_len, coff * config.compress_ratio(layer))


# ---------------------------------------------------------------------------
# Persistent cache and scratch


@dataclass
class LayerBuffers:
    """Named buffers of one layer: persistent [B, S or S // m, width] or scratch [R, width]."""

    tensors: dict[str, torch.Tensor]

    def __getattr__(self, name: str) -> torch.Tensor:  # layer.kv, layer.entries, ...
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class DSV4Cache:
    """Persistent, position-addressed decode state of B requests (capacity S tokens each)."""

    config: DSV4Config
    layers: list[LayerBuffers]
    lengths: torch.Tensor  # [B] int64, tokens whose rows are committed
    max_len: int  # S

    @staticmethod
    def empty(config: DSV4Config, batch_size: int, max_len: int, dtype=torch.float64) -> "DSV4Cache":
        if config.ratios and max_len < max(config.ratios):
            raise ValueError(f"max_len = {max_len} must hold at least one block of the largest ratio "
                             f"{max(config.ratios)}")
        layers = []
        for i in range(config.num_hidden_layers):
            t = {}
            for name, spec in buffer_layout(config, i).items():
                rows = max_len if spec.per == "token" else max_len // spec.ratio
                t[name] = torch.zeros(batch_size, rows, spec.width, dtype=dtype)
            layers.append(LayerBuffers(t))
        return DSV4Cache(config, layers, torch.zeros(batch_size, dtype=torch.long), max_len)

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    def clone(self) -> "DSV4Cache":
        return DSV4Cache(
            self.config,
            [LayerBuffers({k: v.clone() for k, v in layer.tensors.items()}) for layer in self.layers],
            self.lengths.clone(),
            self.max_len,
        )

    def select(self, requests: list[int]) -> "DSV4Cache":
        """A copy holding only the given requests (in that order)."""
        idx = torch.tensor(requests, dtype=torch.long)
        return DSV4Cache(
            self.config,
            [LayerBuffers({k: v[idx].clone() for k, v in layer.tensors.items()}) for layer in self.layers],
            self.lengths[idx].clone(),
            self.max_len,
        )

    def committed(self, b: int) -> dict[tuple[int, str], torch.Tensor]:
        """The meaningful part of request b's state: rows < length, entries < length // m."""
        n = int(self.lengths[b])
        out = {}
        for i, layer in enumerate(self.layers):
            for name, spec in buffer_layout(self.config, i).items():
                rows = n if spec.per == "token" else n // spec.ratio
                out[(i, name)] = layer.tensors[name][b, :rows]
        return out

    def poison_uncommitted(self, value: float = float("nan")) -> None:
        """Fill every row at or past each request's length with `value` (a test aid)."""
        for i, layer in enumerate(self.layers):
            for name, spec in buffer_layout(self.config, i).items():
                for b in range(self.batch_size):
                    n = int(self.lengths[b])
                    layer.tensors[name][b, n if spec.per == "token" else n // spec.ratio :] = value


def new_scratch(config: DSV4Config, num_rows: int, dtype=torch.float64) -> list[LayerBuffers]:
    """Scratch of one forward: every buffer gets one [width] row per query row."""
    return [
        LayerBuffers(
            {
                name: torch.zeros(num_rows, spec.width, dtype=dtype)
                for name, spec in buffer_layout(config, i).items()
            }
        )
        for i in range(config.num_hidden_layers)
    ]


# ---------------------------------------------------------------------------
# Virtual-slot gather / write (the two "kernels" every forward is built from)


def gather_slots(
    persistent: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for virtual slot ids.

    Args:
        persistent: [B, S', d] persistent buffer (S' = S or S // m).
        scratch: [R, d] scratch buffer of the current forward.
        slots: [...] int64 virtual slots (see module docstring), PAD_SLOT = masked.
    Returns:
        rows [..., d] (exactly 0 where masked, so NaN in unread slots cannot leak)
        and valid [...] bool.
    """
    flat = persistent.reshape(-1, persistent.shape[-1])  # [B * S', d]
    n = flat.shape[0]
    valid = slots != PAD_SLOT
    in_scratch = slots >= n
    rows_p = flat[slots.clamp(0, n - 1)]
    rows_s = scratch[(slots - n).clamp(0, max(scratch.shape[0] - 1, 0))] if scratch.shape[0] else rows_p
    rows = torch.where(in_scratch.unsqueeze(-1), rows_s, rows_p)
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype)), valid


def write_slots(persistent: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """persistent[slot] or scratch[slot - B*S'] = values for every slot != PAD_SLOT.

    Args:
        slots: [R] int64, unique apart from PAD_SLOT (the plan guarantees it).
        values: [R, d].
    """
    flat = persistent.view(-1, persistent.shape[-1])  # [B * S', d], a view: writes land in the cache
    n = flat.shape[0]
    to_p = (slots != PAD_SLOT) & (slots < n)
    to_s = slots >= n
    flat[slots[to_p]] = values[to_p]
    scratch[slots[to_s] - n] = values[to_s]


@dataclass
class ByteCount:
    """Bytes moved by a commit: every copied element is read once and written once."""

    by_buffer: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, t: torch.Tensor) -> None:
        self.by_buffer[name] = self.by_buffer.get(name, 0) + t.numel() * t.element_size()

    @property
    def written(self) -> int:
        return sum(self.by_buffer.values())
