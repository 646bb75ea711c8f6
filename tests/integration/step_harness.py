"""A tree step without vLLM's engine: a model runner faked around the plugin's own hooks, and a host-sync counter.

`make_step` builds a `TreeRunnerMixin` instance whose vLLM state (persistent batch, slot mappings,
KV caches in vLLM 0.32's layer-strided allocation, request states) is filled in directly, plus the
scheduler output and logits of one verify step. `run_step` then runs what the engine runs between
the forward and vLLM's bookkeeping: `_tree_build_step` (metadata), `_sample` (verification) and the
commit. Used by the sync-count test.

`SyncCounter` runs code with CPU tensors as if some were on an accelerator: tensors created with an
explicit `device=` (and everything computed from them, and `upload`'s results) count as device
tensors. It counts what would make the host wait for the device -- reading values (`tolist`, `item`,
`bool`, `int`, `nonzero`, boolean-mask indexing, `.cpu()`, copying into a host tensor) -- and
host-to-device transfers (`upload`, factories from host data with `device=`, indexing a device
tensor with a host index tensor), and flags ops that mix device tensors with host tensors, which
would fail on a GPU.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from vllm_tree_spec.integration.adapters import StandardAttentionAdapter
from vllm_tree_spec.integration.runner import TreeRunnerMixin
from vllm_tree_spec.integration.stats import TreeStats
from vllm_tree_spec.integration.worker_memory import HeapTrimmer
from vllm_tree_spec.integration.tree_step import TreeStep
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode


class FakeRunner(TreeRunnerMixin):
    def __init__(self):  # no vLLM runner underneath: make_step sets the state the hooks read
        pass


def random_tree(rng: random.Random, n: int, vocab: int, chain: bool) -> Tree:
    parents = [i - 1 for i in range(n)] if chain else [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    tokens, seen = [], {}
    for p in parents:  # distinct siblings (deterministic drafters)
        used = seen.setdefault(p, set())
        t = rng.randrange(vocab)
        while t in used:
            t = rng.randrange(vocab)
        used.add(t)
        tokens.append(t)
    return Tree(parents, tokens)


def make_step(batch_size: int, nodes: int, *, seed: int = 0, vocab: int = 512, modes=("deterministic",),
              chain: bool = False, seeded: bool = False, layout: str = "cpu_attn", layers: int = 4,
              hkv: int = 2, head_size: int = 16, block_size: int = 16, context: int = 100, temperature=0.8,
              device: str = "cpu", kv_dtype: torch.dtype = torch.float32, isa: str = "vec"):
    """One verify step of `batch_size` tree requests with `nodes` draft nodes each (modes cycled)."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    r = FakeRunner()
    r.tree_cfg = SimpleNamespace(verification_for=lambda mode: mode)
    r.tree_adapter = StandardAttentionAdapter()
    r.drafter = SimpleNamespace(observes_target=False)  # a proposer whose drafter reads no target rows
    r.tree_stats = TreeStats(max_depth=nodes)
    r._tree_step, r._tree_committed, r._tree_drafts = TreeStep([]), {}, {}
    r._tree_heap = HeapTrimmer(0)  # the runner's periodic heap trim, off: steps here are timed and counted
    req_ids = [f"r{b}" for b in range(batch_size)]
    blocks_per_req = -(-(context + batch_size + nodes + 2) // block_size)
    num_blocks = batch_size * blocks_per_req + 1
    block_table = torch.randperm(num_blocks - 1, generator=gen)[: batch_size * blocks_per_req].view(
        batch_size, blocks_per_req) + 1
    qsl, slots, spec, requests = [0], [], {}, {}
    for b, rid in enumerate(req_ids):
        mode = Mode.parse(modes[b % len(modes)])
        n = nodes
        tree = random_tree(rng, n, vocab, chain)
        q = None
        if mode.needs_draft_probs:  # children drawn from q: give their tokens mass in q
            q = torch.softmax(torch.randn(n + 1, vocab, generator=gen), -1)
        r._tree_drafts[rid] = SimpleNamespace(tree=tree, mode=int(mode), draft_probs=q)
        spec[rid] = tree.tokens.tolist()
        ctx = context + b  # root position
        pos = torch.arange(ctx, ctx + n + 1)
        slots.append(block_table[b, pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n + 1)
        sp = SamplingParams(temperature=0.0 if mode == Mode.GREEDY else temperature, max_tokens=1000,
                            seed=1000 + b if seeded else None, ignore_eos=True)
        g = torch.Generator().manual_seed(1000 + b) if seeded and mode != Mode.GREEDY else None
        requests[rid] = SimpleNamespace(sampling_params=sp, output_token_ids=[1, 2, 3],
                                        prompt_token_ids=list(range(ctx - 3)), generator=g)
    R = qsl[-1]
    slot_mapping = torch.cat(slots).to(dev)
    r.input_batch = SimpleNamespace(
        req_ids=req_ids, req_id_to_index={rid: b for b, rid in enumerate(req_ids)}, num_reqs=batch_size,
        num_computed_tokens_cpu=np.array([context + b for b in range(batch_size)], dtype=np.int32),
        block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slot_mapping))],
        sampling_metadata=SimpleNamespace(max_num_logprobs=None, thinking_budget_state_holder=None),
        update_async_output_token_ids=lambda: None)
    r.requests = requests
    r.query_start_loc = SimpleNamespace(np=np.array(qsl, dtype=np.int32))
    r.positions = torch.arange(R, dtype=torch.int64, device=dev)
    r.discard_request_mask = SimpleNamespace(np=np.zeros(batch_size, dtype=bool))
    # vLLM 0.32: the layers of a KV-cache tensor are views of one allocation at a constant layer stride
    buf = torch.randn(layers, num_blocks, hkv, block_size, 2 * head_size, generator=gen).to(kv_dtype).to(dev)
    names = [f"layers.{i}.attn" for i in range(layers)]
    impl = SimpleNamespace(tree_kv_layout=layout, head_size=head_size)
    r.compilation_config = SimpleNamespace(static_forward_context={
        name: SimpleNamespace(kv_cache=buf[i], impl=impl, isa=isa) for i, name in enumerate(names)})
    r.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names)])
    sched = SimpleNamespace(scheduled_spec_decode_tokens=spec)
    spec_meta = SimpleNamespace(num_draft_tokens=[nodes] * batch_size)
    logits = (torch.randn(R, vocab, generator=gen) * 3).to(dev)
    return SimpleNamespace(runner=r, sched=sched, spec_meta=spec_meta, logits=logits, kv=buf)


def run_step(case):
    """metadata + verification + commit of one step; returns vLLM's SamplerOutput."""
    r = case.runner
    r._tree_step = r._tree_build_step(case.sched)
    return r._sample(case.logits, case.spec_meta)


# ---------------------------------------------------------------------------
# Host-sync counting

_D2H = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
        "masked_select", "unique", "unique_consecutive", "any_", "argwhere", "nonzero_static"}
_FACTORIES_FROM_DATA = {"tensor", "as_tensor", "from_numpy"}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, "_sync_counter_device", False)


def mark(t):
    for x in _tensors(t):
        try:
            x._sync_counter_device = True
        except (AttributeError, RuntimeError):
            pass
    return t


class SyncCounter(TorchFunctionMode):
    """Counts device->host syncs (`d2h`), host->device transfers (`h2d`) and device/host mixes (`mixed`)."""

    def __init__(self):
        super().__init__()
        self.d2h, self.h2d, self.mixed = Counter(), Counter(), Counter()
        self.where = {}
        self._in_cpu = 0

    def _note(self, kind: Counter, what: str) -> None:
        kind[what] += 1
        self.where.setdefault(what, "".join(traceback.format_stack(limit=8)[:-2]))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        dev_in = [t for t in ins if on_device(t)]
        host_in = [t for t in ins if not on_device(t) and t.dim() > 0]
        if dev_in and name in _D2H:
            self._note(self.d2h, name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and dev_in:
            index = args[1] if len(args) > 1 else None
            idx = list(_tensors(index))
            if any(t.dtype == torch.bool for t in idx):
                self._note(self.d2h, f"{name}[bool mask]")
            if on_device(args[0]) and any(not on_device(t) and t.dim() > 0 for t in idx):
                self._note(self.h2d, f"{name}[host index]")
            if name == "__setitem__" and not on_device(args[0]):
                self._note(self.d2h, "__setitem__ into a host tensor")
        elif name in ("copy_",) and dev_in and not on_device(args[0]):
            self._note(self.d2h, "copy_ into a host tensor")
        elif name == "to" and dev_in and self._to_cpu(args, kwargs) and not self._in_cpu:  # .cpu() calls .to
            self._note(self.d2h, "to(cpu)")
        elif dev_in and host_in and name not in ("__getitem__", "__setitem__", "__repr__", "__format__"):
            self._note(self.mixed, name)
        if not dev_in and name in _FACTORIES_FROM_DATA and kwargs.get("device") is not None:
            self._note(self.h2d, f"{name}(device=)")
        self._in_cpu += name == "cpu"
        try:
            out = func(*args, **kwargs)
        finally:
            self._in_cpu -= name == "cpu"
        to_host = name == "cpu" or name == "to" and self._to_cpu(args, kwargs)
        if dev_in and to_host and isinstance(out, torch.Tensor):
            with torch._C.DisableTorchFunction():
                return out.clone()  # a host copy (on CPU .cpu() returns the tensor itself)
        if (dev_in or kwargs.get("device") is not None) and name not in _D2H:
            mark(out)
        return out

    @staticmethod
    def _to_cpu(args, kwargs) -> bool:
        # `.to("cpu")` is a host copy; `.to(device)` with the device object is the device (here also CPU)
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(isinstance(a, str) and torch.device(a).type == "cpu" for a in targets)

    def counting_upload(self, real):
        def upload(tensors, device):
            self.h2d["upload"] += 1
            with torch._C.DisableTorchFunction():  # the packed transfer itself
                return [mark(t.clone()) for t in real(tensors, device)]
        return upload

    def counting_upload_floats(self, real):
        def upload_floats(tensors, device):
            if tensors:
                self.h2d["upload"] += 1
            with torch._C.DisableTorchFunction():
                return [mark(t.clone()) for t in real(tensors, device)]
        return upload_floats


def mark_case(case) -> None:
    """The harness tensors that live on the device in the engine."""
    r = case.runner
    mark(case.logits)
    mark(case.kv)
    mark(r.positions)
    mark(r.input_batch.block_table[0].slot_mapping.gpu)
    for layer in r.compilation_config.static_forward_context.values():
        mark(layer.kv_cache)
    for dt in r._tree_drafts.values():
        if dt.draft_probs is not None:
            mark(dt.draft_probs)
