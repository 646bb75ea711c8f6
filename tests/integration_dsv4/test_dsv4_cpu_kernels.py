"""The torch ports of vLLM's DeepSeek-V4 metadata kernels (patch D5) equal the Triton kernels.

The original kernels run in Triton's interpreter here (the conftest enables it),
so each port is compared with the kernel it replaces on random batches of
prefill / decode / verify-shaped requests. The conftest installs the ports for
the whole session; the originals are rebuilt from vLLM's kernel classes.
"""

import random

import pytest
import torch

from vllm_tree_spec.integration.dsv4 import cpu_kernels

pytestmark = pytest.mark.vllm
NEEDS_VLLM_DSV4_KERNELS = False  # Triton kernels (interpreted) and torch ports only (conftest.py)


def _batch(seed: int, block_size: int, max_blocks: int = 12):
    rng = random.Random(seed)
    num_reqs = rng.randint(1, 5)
    qlens = [rng.choice([1, rng.randint(2, 9), rng.randint(10, 70)]) for _ in range(num_reqs)]
    seq_lens = [q + rng.randint(0, block_size * (max_blocks - 2) - q) for q in qlens]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    bt = torch.randint(1, 500, (num_reqs, max_blocks), dtype=torch.int32,
                       generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, qlens)]).to(torch.int64)
    return qsl, torch.tensor(seq_lens, dtype=torch.int32), bt, positions


@pytest.mark.parametrize("seed", range(6))
def test_token_to_req_and_slot_mapping(seed):
    from vllm.v1.attention.ops import metadata
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel

    qsl, seq_lens, bt, positions = _batch(seed, 64)
    n = int(qsl[-1])
    ref = torch.zeros(n + 8, dtype=torch.int32)
    metadata._token_request_mapping_kernel[((n + 8 + 255) // 256,)](qsl, ref, qsl.shape[0] - 1, n, n + 8)
    got = torch.zeros(n + 8, dtype=torch.int32)
    cpu_kernels.compute_token_to_req_indices(qsl, got, n, n + 8)
    assert torch.equal(ref, got)

    ref_sm = torch.full((n + 16,), 7, dtype=torch.int64)
    got_sm = ref_sm.clone()
    args = (len(qsl) - 1, n, n + 16, qsl, positions, bt, bt.stride(0))
    ComputeSlotMappingKernel()(*args, ref_sm, 64, 1, 0, 1)
    cpu_kernels.SlotMapping()(*args, got_sm, 64, 1, 0, 1)
    assert torch.equal(ref_sm, got_sm)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_slot_mapping(seed, ratio):
    from vllm.v1.attention.backends.mla.compressor_utils import CompressedSlotMappingKernel

    qsl, seq_lens, bt, positions = _batch(seed, 256)
    n = int(qsl[-1])
    slot_mapping = torch.arange(n, dtype=torch.int64) * 3
    slot_mapping[:: 5] = -1  # some PAD (replayed) tokens
    ref = torch.full((n,), -1, dtype=torch.int64)
    got = ref.clone()
    block = 256 // ratio
    CompressedSlotMappingKernel()(ref, slot_mapping, qsl, seq_lens, bt, block, ratio, 1, 1)
    cpu_kernels.CompressedSlotMapping()(got, slot_mapping, qsl, seq_lens, bt, block, ratio, 1, 1)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("seed", range(6))
def test_swa_indices_and_lens(seed):
    from vllm.v1.attention.backends.mla.sparse_swa import ComputeSWAIndicesAndLensKernel

    qsl, seq_lens, bt, positions = _batch(seed, 64)
    n = int(qsl[-1])
    t2r = torch.zeros(n, dtype=torch.int32)
    cpu_kernels.compute_token_to_req_indices(qsl, t2r, n, n)
    valid = torch.ones(n, dtype=torch.bool)
    valid[::7] = False
    replay = torch.zeros(len(qsl), dtype=torch.int32)
    split = n // 2
    for offset, count in ((0, split), (split, n - split)):
        ref_i = torch.full((n, 1, 128), 99, dtype=torch.int32)
        ref_l = torch.full((n,), 99, dtype=torch.int32)
        got_i, got_l = ref_i.clone(), ref_l.clone()
        common = (128, 128, ref_l, ref_l, qsl, seq_lens, t2r, valid, bt, 64, replay)
        ComputeSWAIndicesAndLensKernel()(ref_i, ref_l, *common, num_tokens=count, token_offset=offset)
        cpu_kernels.SWAIndicesAndLens()(got_i, got_l, *common, num_tokens=count, token_offset=offset)
        assert torch.equal(ref_i, got_i) and torch.equal(ref_l, got_l)
