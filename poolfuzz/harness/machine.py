"""The Hypothesis state machine: rules draw small ints, the engine plays them on real pools."""

from __future__ import annotations

from hypothesis import event as _hypothesis_event
from hypothesis import target as _hypothesis_target
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from poolfuzz.harness.engine import NODES, Engine, EngineOptions, Phase
from poolfuzz.pools.config import CONFIGS, ModelConfig
from poolfuzz.strategies import chunk_sizes, extra_tokens, picks, prompt_lengths


def event(label: str) -> None:
    """Label an interesting state for Hypothesis statistics; a no-op when a printed program is
    replayed by hand, outside any test."""
    try:
        _hypothesis_event(label)
    except InvalidArgument:
        pass


def _target(value: float, label: str) -> None:
    try:
        _hypothesis_target(value, label=label)
    except InvalidArgument:
        pass


def _has(phase: Phase, node: str | None = None):
    return lambda self: bool(self.engine.live(phase, node))


def _supports(op: str):
    """A family may decline a whole operation (``supports_fork = False``): plug-ins over real pools."""
    return lambda self: getattr(self.engine.families["prefill"], f"supports_{op}", True)


class PoolMachine(RuleBasedStateMachine):
    """Plays a small serving engine over a real family and its reference model.

    Configure it with :func:`machine_for`; the class attributes are the defaults.
    """

    config: ModelConfig = CONFIGS["swa-ssm"]
    device = "cpu"
    faults: tuple[str, ...] = ()
    backup_mode: str | None = None
    options = EngineOptions()
    family_factory = None

    def __init__(self):
        super().__init__()
        cls = type(self)
        kwargs = {} if cls.family_factory is None else {"family_factory": cls.family_factory}
        self.engine = Engine(config=cls.config, device=cls.device, faults=cls.faults,
                             backup_mode=cls.backup_mode, options=cls.options, **kwargs)

    def _pick(self, phase: Phase, pick: int, node: str | None = None):
        live = self.engine.live(phase, node)
        return live[pick % len(live)]

    @initialize(prompts=st.lists(prompt_lengths, min_size=1, max_size=3))
    def warm_start(self, prompts):
        """A server already serving: requests admitted and prefilled in one go.

        Initialize rules always run, whichever rules Hypothesis's swarm testing switches off for
        the example, so every example starts with running requests (and pools in use) rather
        than stalling when ``admit`` or ``prefill`` is off."""
        event(f"config {self.engine.config.name}")
        # Every engine step is checked, as after a rule: each check here covers the step before
        # it (step 0 is a full sweep of the empty pools), and the invariant after this rule the last.
        for prompt_len in prompts:
            self.engine.check()
            rid = self.engine.admit(prompt_len)
            if rid is not None:
                self.engine.check()
                self.engine.prefill(rid, prompt_len)

    @rule(prompt_len=prompt_lengths)
    def admit(self, prompt_len):
        if self.engine.admit(prompt_len) is None:
            event("pool full at admit")

    @precondition(_has(Phase.PREFILLING))
    @rule(pick=picks, chunk=chunk_sizes)
    def prefill(self, pick, chunk):
        if not self.engine.prefill(self._pick(Phase.PREFILLING, pick).rid, chunk):
            event("pool full at prefill")

    @precondition(_has(Phase.RUNNING))
    @rule(picks=st.lists(picks, min_size=1, max_size=3))
    def decode(self, picks):
        live = self.engine.live(Phase.RUNNING)
        rids = list(dict.fromkeys(live[p % len(live)].rid for p in picks))
        if len(self.engine.decode(rids)) < len(rids):
            event("pool full at decode")

    @precondition(_has(Phase.RUNNING))
    @rule(pick=picks, draft=st.integers(1, 3), accepted=st.integers(0, 3))
    def decode_speculative(self, pick, draft, accepted):
        """MTP / EAGLE: draft tokens get KV slots, rejected ones are released after verify."""
        if not self.engine.decode_speculative(self._pick(Phase.RUNNING, pick).rid, draft, accepted):
            event("pool full at speculative decode")

    @precondition(_has(Phase.RUNNING))
    @rule(pick=picks)
    def retract(self, pick):
        """Retract an arbitrary running request (a scheduler may pick any victim)."""
        if self.engine.retract(self._pick(Phase.RUNNING, pick).rid) == "aborted":
            event("retraction backup did not fit: aborted")

    @precondition(lambda self: any(self.engine.sglang_victim(n) for n in NODES))
    @rule()
    def retract_sglang_order(self):
        """Retract the victim SGLang would choose (fewest outputs, then longest prompt)."""
        node = next(n for n in NODES if self.engine.sglang_victim(n))
        self.engine.retract(self.engine.sglang_victim(node))

    @precondition(_has(Phase.RETRACTED))
    @rule()
    def resume(self):
        node = next(n for n in NODES if self.engine.retracted[n])
        rid = self.engine.retracted[node][0]
        before = self.engine.requests[rid].slots_before
        if self.engine.resume(node) is None:
            event("pool full at resume")
        elif before and before.get("mamba") is not None:
            same = self.engine.requests[rid].kv.mamba_pool_idx == before["mamba"]
            event("resumed into its old mamba slot" if same else "resumed into a different mamba slot")

    @precondition(_has(Phase.RETRACTED))
    @rule(pick=picks)
    def abort(self, pick):
        """Abort a retracted request: its backup is discarded and nothing may leak.

        (Aborting live requests too would give the shrinker an admit/abort pair to trip over:
        it then stops at programs several times longer. ``finish`` releases live requests.)
        """
        self.engine.abort(self._pick(Phase.RETRACTED, pick).rid)

    @precondition(_has(Phase.RUNNING))
    @rule(pick=picks)
    def finish(self, pick):
        self.engine.finish(self._pick(Phase.RUNNING, pick).rid)

    @precondition(lambda self: _supports("transfer")(self) and _has(Phase.RUNNING, "prefill")(self))
    @rule(pick=picks)
    def transfer(self, pick):
        if not self.engine.transfer(self._pick(Phase.RUNNING, pick, "prefill").rid):
            event("decode node full at transfer")

    @precondition(lambda self: _supports("fork")(self) and _has(Phase.RUNNING)(self))
    @rule(pick=picks, extra=extra_tokens)
    def fork(self, pick, extra):
        if self.engine.fork(self._pick(Phase.RUNNING, pick).rid, extra) is None:
            event("pool full at fork")

    @invariant()
    def pools_agree_with_reference(self):
        self.engine.check()
        for label in sorted(getattr(self.engine, "events", ())):
            event(label)
        self._pressure = max(getattr(self, "_pressure", 0.0), self.engine.pressure())

    def teardown(self):
        # Steer Hypothesis's targeted phase towards full pools: exhaustion, reuse and failed
        # resumes are where the allocation bugs live.
        _target(getattr(self, "_pressure", 0.0), "peak pool pressure")
        if not self.engine.broken:  # a step failed: its report stands, nothing more to check
            self.engine.sweep()
            self.engine.drain()


def machine_for(config: ModelConfig | str, *, device="cpu", faults=(), backup_mode: str | None = None,
                options: EngineOptions = EngineOptions(), family_factory=None) -> type[PoolMachine]:
    """A PoolMachine subclass bound to one config, device, fault set and backup mode."""
    if isinstance(config, str):
        from poolfuzz.pools.config import get_config

        config = get_config(config)
    attrs = dict(config=config, device=device, faults=tuple(faults), backup_mode=backup_mode, options=options)
    if family_factory is not None:
        attrs["family_factory"] = staticmethod(family_factory)
    # Its own key in Hypothesis's example database, shared by ``poolfuzz run`` and a plain test of it.
    from poolfuzz.orchestration.database import machine_identity

    attrs["_hypothesis_internal_add_digest"] = machine_identity(config, faults, backup_mode, family_factory, options)
    return type("PoolMachine", (PoolMachine,), attrs)
