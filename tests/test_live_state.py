"""The live-state listing (integration/live_state.py) on a stand-in runner: it finds a drafter's per-request
containers without being told their names, and the leak check flags an id vLLM no longer holds."""

from types import SimpleNamespace

from vllm_tree_spec.integration.live_state import counts, leaks, live_state


class _Drafter:
    def __init__(self):
        self._prompt_len = {"a": 3}
        self._states = {"a": object(), "gone": object()}  # "gone" finished in vLLM, never dropped here
        self.layer_ids = {0: "x"}  # not keyed by request ids: not per-request state

    @property
    def active_requests(self):
        return list(self._prompt_len)


def _runner():
    batch = SimpleNamespace(req_ids=["a", None], generators={0: object()})
    return SimpleNamespace(requests={"a": object()}, input_batch=batch, _tree_drafts={"a": 1}, _tree_committed={},
                           _tree_skip_logged=set(), _tree_step=SimpleNamespace(requests=[]),
                           drafter=SimpleNamespace(drafter=_Drafter()))


def test_listing_finds_per_request_containers_and_the_leak():
    state = live_state(_runner())
    assert state["vllm.requests"] == ["a"] and state["vllm.generators"] == ["a"]
    assert state["drafter.states"] == ["a", "gone"] and "drafter.layer_ids" not in state
    assert "drafter.prompt_len" not in state and state["drafter.active"] == ["a"]
    assert leaks(state) == {"drafter.states": ["gone"]}
    assert counts(state)["drafter.states"] == 2


def test_no_leak_when_every_place_holds_live_requests_only():
    runner = _runner()
    del runner.drafter.drafter._states["gone"]
    assert leaks(live_state(runner)) == {}
    assert leaks(live_state(runner), live=set()) == {p: ["a"] for p in ("vllm.requests", "vllm.batch", "vllm.generators",
                                                                        "runner.drafts", "drafter.active",
                                                                        "drafter.states")}
