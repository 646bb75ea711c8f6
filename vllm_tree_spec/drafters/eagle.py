"""EAGLE-1 tree drafter: the head vLLM's linear `eagle` loads, on the EAGLE-3 drafter's machinery.

Everything but the head and its input is `eagle3.py`: committed head KV per request slot, one
forward per tree level for all requests, node g' = the head's output at the parent, q over the
head's vocabulary. The differences (`eagle_head.py`):

* the feature at committed position t is the target's last hidden state there (vLLM's EAGLE-1
  input: the target model's output, after its final norm), not auxiliary layers; the runner hands
  it over with each step's committed rows (`integration/eagle3_aux.py`, P7);
* the head's layers run on fc(concat(embed(token), feature)), with no final norm, and its logits
  come from the target's LM head unless the checkpoint has one; the vocabulary is the target's.
"""

from __future__ import annotations

from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter, shared_table, target_embedding_layer
from vllm_tree_spec.drafters.eagle_head import load_eagle_head

__all__ = ["EagleTreeDrafter"]


class EagleTreeDrafter(Eagle3TreeDrafter):
    """Tree drafts from an EAGLE-1 head (`eagle_head.EagleHead`) fed by the target's last hidden state.

    Args: as `Eagle3TreeDrafter` (head: a loaded `EagleHead`, or None to load `path` in `load_model`).
    """

    key = "eagle"
    reads_aux_hidden_states = False
    reads_hidden_states = True  # the runner hands over the target's output hidden states

    def load_model(self, target_model=None) -> None:
        """Load the head, sharing the target's input embedding and LM head where the checkpoint has none."""
        if self.head is not None:
            return
        emb = lm_head = None
        if target_model is not None:
            who = f"EAGLE head {self.path}"
            emb = shared_table(target_embedding_layer(target_model), who, "embedding")
            out = getattr(target_model, "lm_head", None)
            lm_head = None if getattr(out, "weight", None) is None else shared_table(out, who, "LM head")
        self.set_head(load_eagle_head(self.path, target_embedding=emb, target_lm_head=lm_head, dtype=self.dtype,
                                       device=self.device))

    @property
    def aux_layer_ids(self) -> None:
        return None
