"""The cache comparison of the DeepSeek-V4 suites (dsv4_harness.compare_snapshots), on emulated fp8 rows.

No engine: rows are quantized here the way vLLM 0.32 writes its DeepSeek-V4 caches
(UE8M0 power-of-two scale per block, e4m3 codes; vllm_tree_spec/integration/dsv4/layout.py
has the byte layouts), from RMS-normalized random rows with per-channel gains (what the
tiny checkpoint's normalized KV looks like).

* Rounding noise upstream of the quantizer, as Intel AMX's multi-row GEMMs add it
  (emulated: relative or absolute noise on the bf16 input), sized so that the old
  byte comparison sees what was measured on AMX (worst row: 19-22 % of bytes differ,
  most of them one code apart), leaves no value more than one code step apart.
* Rows of another token (a wrong branch, a stale slot), rows that share 90 % of their
  signal, and C4-style entries pooled over one wrong row out of four fail.
"""

import pytest
import torch
from dsv4_harness import (ROW_REL_TOL, ROW_STEP_TOL, code_steps, compare_snapshots, dequantize_rows,
                          snapshot_mismatches)

E4M3 = torch.float8_e4m3fn
ROWS = 40  # about the rows one request's generated tokens put into a store in the suites' runs


def ds_mla_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, 512] -> [n, 584] uint8: 448 e4m3 codes (7 blocks of 64, UE8M0 scales), 64 bf16 RoPE values."""
    x = x.to(torch.bfloat16).float()
    n = x.shape[0]
    nope = x[:, :448].reshape(n, 7, 64)
    exp = torch.ceil(torch.log2((nope.abs().amax(-1) / 448).clamp(min=2.0 ** -100)))  # [n, 7]
    codes = (nope / torch.exp2(exp)[..., None]).to(E4M3).view(torch.uint8).reshape(n, 448)
    rope = x[:, 448:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [n, 128]
    scales = torch.cat([(exp + 127).to(torch.uint8), torch.zeros(n, 1, dtype=torch.uint8)], dim=1)  # [n, 8]
    return torch.cat([codes, rope, scales], dim=1)


def indexer_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 132] uint8: e4m3 codes and one fp32 (power-of-two) scale."""
    x = x.to(torch.bfloat16).float()
    scale = torch.exp2(torch.ceil(torch.log2((x.abs().amax(-1, keepdim=True) / 448).clamp(min=2.0 ** -100))))
    codes = (x / scale).to(E4M3).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=1)


STORES = {"swa": (512, ds_mla_rows), "indexer": (128, indexer_rows)}


def normalized_rows(g: torch.Generator, n: int, dim: int) -> torch.Tensor:
    gains = torch.exp(0.5 * torch.randn(1, dim, generator=g))
    x = torch.randn(n, dim, generator=g) * gains
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def rounding_noise(g: torch.Generator, x: torch.Tensor, eps: float, kind: str) -> torch.Tensor:
    """x as another kernel's rounding would leave it: relative noise eps, or absolute eps x the row's RMS."""
    x = x.to(torch.bfloat16).float()
    n = torch.randn(x.shape, generator=g)
    return x * (1 + eps * n) if kind == "relative" else x + eps * n * x.pow(2).mean(-1, keepdim=True).sqrt()


def worst_byte_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """The comparison this replaces: the worst row's fraction of differing bytes."""
    return float((a != b).float().mean(-1).max())


@pytest.mark.parametrize("store", sorted(STORES))
def test_dequantize_recovers_values(store):
    dim, quant = STORES[store]
    x = normalized_rows(torch.Generator().manual_seed(0), ROWS, dim)
    values, blocks, units = dequantize_rows(quant(x))
    # e4m3 rounds to the nearest code: within half a step, and steps are at most one unit
    err = (values - x.to(torch.bfloat16).double()).abs() / units[:, blocks]
    assert float(err.max()) <= 0.5 + 1e-9
    assert int(blocks.max()) + 1 == units.shape[1] == (8 if store == "swa" else 1)


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("kind,eps", [("relative", 0.008), ("absolute", 0.004)])
def test_rounding_noise_stays_within_one_code_step(store, kind, eps):
    dim, quant = STORES[store]
    g = torch.Generator().manual_seed(1)
    byte_fractions = []
    for _ in range(10):
        x = normalized_rows(g, ROWS, dim)
        a, b = quant(x), quant(rounding_noise(g, x, eps, kind))
        byte_fractions.append(worst_byte_fraction(a, b))
        steps = code_steps(a, b)
        assert float(steps.max()) <= 1.0, "a rounding flip moved a value by more than one code step"
        assert compare_snapshots({store: a}, {store: b}) == {store: 0.0}
    # the emulation is at least as rough as AMX was (worst rows 0.19-0.22): the byte comparison (5 %) fails it
    assert min(byte_fractions) > 0.1 and sum(byte_fractions) / len(byte_fractions) >= 0.15, byte_fractions


@pytest.mark.parametrize("store", sorted(STORES))
def test_eight_times_that_noise_still_passes(store):
    """Margin: noise far above what AMX produced leaves a few values beyond one step, well below the tolerance."""
    dim, quant = STORES[store]
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for kind, eps in (("relative", 0.064), ("absolute", 0.032)):
        x = normalized_rows(g, ROWS, dim)
        a, b = quant(x), quant(rounding_noise(g, x, eps, kind))
        worst = max(worst, compare_snapshots({store: a}, {store: b})[store])
    assert worst <= ROW_STEP_TOL / 2, worst


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("shared", [0.0, 0.5, 0.9])
def test_other_rows_fail(store, shared):
    """A row of another token (shared 0), or one sharing a fraction `shared` of its signal, fails: every row."""
    dim, quant = STORES[store]
    g = torch.Generator().manual_seed(3)
    x = normalized_rows(g, 200, dim)
    y = shared * x + (1 - shared ** 2) ** 0.5 * normalized_rows(g, 200, dim)
    frac = (code_steps(quant(x), quant(y)) > 1).double().mean(-1)  # [200]
    assert float(frac.min()) > ROW_STEP_TOL, float(frac.min())
    assert snapshot_mismatches({store: quant(x[:1])}, {store: quant(y[:1])})


@pytest.mark.parametrize("store", sorted(STORES))
def test_entry_pooled_over_one_wrong_row_fails(store):
    """A compressed entry (softmax-pooled over 4 rows) whose completing row came from a wrong branch fails
    unless that row's pooling weight is small (below about 0.15, where it moves values by less than a step)."""
    dim, quant = STORES[store]
    g = torch.Generator().manual_seed(4)
    rows = normalized_rows(g, 4 * 200, dim).view(200, 4, dim)
    w = torch.softmax(torch.randn(200, 4, 1, generator=g), dim=1)
    wrong = rows.clone()
    wrong[:, 3] = normalized_rows(g, 200, dim)

    def pool(r):
        e = (w * r).sum(1)
        return e / e.pow(2).mean(-1, keepdim=True).sqrt()

    frac = (code_steps(quant(pool(rows)), quant(pool(wrong))) > 1).double().mean(-1)  # [200]
    weighty = w[:, 3, 0] >= 0.15
    assert int(weighty.sum()) > 100 and float(frac[weighty].min()) > ROW_STEP_TOL, float(frac[weighty].min())


def test_scale_change_is_no_mismatch():
    """Two rows whose block maximum straddles a power of two get different UE8M0 scales: still within a step."""
    x = normalized_rows(torch.Generator().manual_seed(5), 1, 512)
    x[0, :64] *= 448 / float(x[0, :64].abs().max()) * 2.0 ** -8  # block max exactly at a scale boundary
    a, b = ds_mla_rows(x), ds_mla_rows(x * (1 + 2.0 ** -7))
    assert a[0, 576] != b[0, 576]  # the first block's scale byte differs
    assert float(code_steps(a, b).max()) <= 1.0


def test_nan_code_and_shape_change_fail():
    x = normalized_rows(torch.Generator().manual_seed(6), 2, 512)
    a = ds_mla_rows(x)
    b = a.clone()
    b[1, 5] = 0x7F  # e4m3 NaN
    assert compare_snapshots({"swa": a}, {"swa": b})["swa"] > 0
    assert float(code_steps(a, b)[1, 5]) == float("inf")
    assert compare_snapshots({"swa": a}, {"swa": a[:1]})["swa"] == float("inf")


def test_fp32_rows_relative_tolerance():
    x = torch.randn(4, 16)
    assert snapshot_mismatches({"state": x}, {"state": x + ROW_REL_TOL / 2}) == {}
    assert snapshot_mismatches({"state": x}, {"state": torch.randn(4, 16)})


def test_unknown_row_width_is_refused():
    with pytest.raises(ValueError, match="584 or 132"):
        dequantize_rows(torch.zeros(1, 100, dtype=torch.uint8))
