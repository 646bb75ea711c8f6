"""The draft-model tree drafter on the runner's paged KV cache (Model Runner V2).

On V2 the draft model is vLLM's own model of the draft checkpoint, loaded as vLLM's standalone draft-model
speculator loads it (tensor-parallel shards on every rank; `integration/v2/draft_head.py`), and its committed
KV lives in vLLM's paged KV cache with the target's (`integration/v2/draft_kv.py`). Drafting is the EAGLE
drafters' level machinery (`eagle3.py`) with no target features: entry t of a request is token x_t at
position t (not EAGLE's shifted pairing), every entry is computed by the draft model itself (so prefix-cache
hits need no restore), and a tree node at depth d sits at position root + d.

The root entry x_{n-1} (the token the target just emitted) has a cache slot only once the target's next
step is scheduled, so it is fed on every step (its output is q at the root) and written to the pages one
step later, when its slot exists (`persist_last`). The V1 runner keeps `DraftModelTreeDrafter`
(`draft_model.py`: a transformers model with its own dense KV).
"""

from __future__ import annotations

from vllm_tree_spec.drafters.base import DrafterError
from vllm_tree_spec.drafters.draft_model import PREFILL_CHUNK
from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter


class RunnerDraftModelTreeDrafter(Eagle3TreeDrafter):
    """Tree drafts from a draft model run by the runner (`set_head`: `draft_head.VllmDraftModel`), its KV in the
    runner's pages (`use_runner_kv`). Args: as `Eagle3TreeDrafter` (`path`: the draft checkpoint)."""

    key = "draft_model"
    reads_aux_hidden_states = False
    entry_shift = 0
    reads_features = False
    persist_last = False
    feed_chunk = PREFILL_CHUNK  # a prompt is computed here, not by the target's chunked prefill

    def load_model(self, target_model=None) -> None:
        if self.head is None:
            raise DrafterError(f"draft model {self.path}: on Model Runner V2 the runner loads it "
                               f"(integration/v2/draft_head.py); this drafter does not load models itself")

    @property
    def aux_layer_ids(self) -> None:
        return None
