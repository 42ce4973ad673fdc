"""The Hypothesis state machine: rules draw small ints, the engine plays them on real pools."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import ClassVar, Protocol

from hypothesis import event as _hypothesis_event
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis import target as _hypothesis_target
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from poolfuzz.errors import ConfigError
from poolfuzz.harness.engine import Engine
from poolfuzz.harness.forward import tree_verifies
from poolfuzz.harness.hypothesis_compat import set_database_identity
from poolfuzz.harness.records import NODES, EngineOptions, Phase, StepRecord
from poolfuzz.pools.capabilities import factory_capabilities
from poolfuzz.pools.config import CONFIGS, ModelConfig, get_config
from poolfuzz.pools.family import build_family, expected_backup_mode, resolved_backup_mode
from poolfuzz.strategies import (DRAWN_NAME, accepted_drafts, drawn_configs, chunk_sizes, decode_picks, draft_lengths, extra_tokens, picks,
                                 prompt_lengths, token_unit, warm_prompts)


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


class MachineObserver(Protocol):
    """Told what each example does, by the machine itself: how a runner counts and records."""

    def example_started(self) -> None:
        """A new example is about to build its engine (raising here stops the run)."""

    def step_ran(self, engine: Engine) -> None:
        """A step (or the warm start) ran; its checks run next."""

    def example_failed(self, engine: Engine | None, exc: BaseException, steps: tuple[StepRecord, ...],
                       in_teardown: bool) -> bool:
        """The example failed: ``steps`` is its program up to and including the failing operation
        (``engine`` is an ``_Unbuilt`` stand-in when building failed). True: a known bug, not to be
        reported; the machine then rejects the example, so Hypothesis neither reports nor shrinks it
        and steers its search away from it."""

    def example_ended(self, engine: Engine) -> None:
        """The example is over, failed or not (its engine's counters are final)."""

    def example_declined(self, config: ModelConfig, reason: str) -> None:
        """The example's drawn config is one the family declines: rejected, nothing ran."""


class DeclineLog:
    """The filter of drawn configs by a family's ``unsupported_reason``, keeping the last reason it gave."""

    def __init__(self, decline):
        self.decline = decline
        self.last: str | None = None

    def accepts(self, config: ModelConfig) -> bool:
        """Whether the draw is accepted; the reason where not (an accepted draw clears the refusals before it: they are
        not the example's)."""
        self.last = self.decline(config) or None
        return self.last is None


@dataclass(frozen=True, kw_only=True)
class _Unbuilt:
    """What the observer is told of an engine whose construction failed: its config and path."""

    config: ModelConfig
    backup_mode: str
    step: int = 0
    op: str = "init"
    action: str = "init"
    pools_origin: None = None  # no pools were built


def _has(phase: Phase, node: str | None = None):
    return lambda self: bool(self.engine.live(phase, node))


def _supports(op: str):
    """A family may decline a whole operation (``supports_fork = False``): plug-ins over real pools."""
    return lambda self: getattr(self.engine.caps["prefill"], f"supports_{op}")  # a Capabilities field


def _tree_drafts(self) -> bool:
    return tree_verifies(self.engine)


class PoolMachine(RuleBasedStateMachine):
    """Plays a small serving engine over a real family and its reference model.

    Configure it with :func:`machine_for`; the class attributes are the defaults.
    """

    config: ClassVar[ModelConfig] = CONFIGS["swa-ssm"]
    device: ClassVar[str] = "cpu"
    faults: ClassVar[tuple[str, ...]] = ()
    backup_mode: ClassVar[str | None] = None
    options: ClassVar[EngineOptions] = EngineOptions()
    family_factory = None  # a staticmethod when set: factory(config, *, device, faults, backup_mode)
    observer: ClassVar[MachineObserver | None] = None
    # Set (by machine_for) when the config is drawn inside each example: the engine is then built
    # by warm_start, which draws the config and the warm-start prompts in one rule.
    config_strategy: ClassVar[st.SearchStrategy[ModelConfig] | None] = None
    decline_log: ClassVar["DeclineLog | None"] = None  # drawn configs: why the family refused the last draw

    def __init__(self):
        super().__init__()
        cls = type(self)
        if cls.observer is not None:
            cls.observer.example_started()
        if cls.decline_log is not None:
            cls.decline_log.last = None
        self.peak_pressure = 0.0  # the fullest any device pool got in this example
        self.scale = 1
        self.engine = None if cls.config_strategy is not None else self._build(cls.config, drawn=False)

    def _new_engine(self, config: ModelConfig) -> Engine:
        cls = type(self)
        kwargs = {} if cls.family_factory is None else {"family_factory": cls.family_factory}
        self.scale = token_unit(config)  # prompts and chunks are drawn in these units of tokens
        return Engine(config=config, device=cls.device, faults=cls.faults, backup_mode=cls.backup_mode,
                      options=cls.options, **kwargs)

    def _pick(self, phase: Phase, pick: int, node: str | None = None):
        live = self.engine.live(phase, node)
        return live[pick % len(live)]

    @initialize(prompts=warm_prompts)
    def warm_start(self, prompts):
        """A server already serving: requests admitted and prefilled in one go.

        Initialize rules always run, whichever rules Hypothesis's swarm testing switches off for
        the example, so every example starts with running requests (and pools in use) rather
        than stalling when ``admit`` or ``prefill`` is off."""
        self._warm(prompts)

    def _build(self, config: ModelConfig, *, drawn: bool) -> Engine:
        """The engine of ``config``. A drawn config the family declines (its ``unsupported_reason``, or
        a ConfigError while building) rejects the example: it is not a failure. A failure while
        building (an audit, a crash) is a failure at step 0, told to the observer like any other."""
        cls = type(self)
        # A draw through the decline log was filtered by the same predicate already: ask only of other draws.
        decline = factory_capabilities(cls.family_factory).unsupported_reason
        reason = decline(config) if drawn and decline is not None and cls.decline_log is None else None
        if reason:
            self._declined(config, reason)
        try:
            return self._new_engine(config)
        except ConfigError as exc:
            if drawn:
                self._declined(config, str(exc))
            raise
        except Exception as exc:
            mode = expected_backup_mode(config, cls.faults, cls.backup_mode, cls.family_factory)
            if self._report(_Unbuilt(config=config, backup_mode=mode), exc, (), in_teardown=False):
                reject()
            raise

    def _declined(self, config: ModelConfig, reason: str):
        """Reject the example of a drawn config the family declines, telling the observer (a run counts them)."""
        if type(self).observer is not None:
            type(self).observer.example_declined(config, reason)
        reject()

    def _warm(self, prompts) -> None:
        event(f"config {self.engine.config.name}")
        # Every engine step is checked, as after a rule: each check here covers the step before
        # it (step 0 is a full sweep of the empty pools), and the invariant after this rule the last.
        for prompt_len in prompts:
            prompt_len *= self.scale
            self.engine.check()
            rid = self.engine.admit(prompt_len)
            if rid is not None:
                self.engine.check()
                self.engine.prefill(rid, prompt_len)

    @rule(prompt_len=prompt_lengths)
    def admit(self, prompt_len):
        if self.engine.admit(prompt_len * self.scale) is None:
            event("pool full at admit")

    @precondition(_has(Phase.PREFILLING))
    @rule(pick=picks, chunk=chunk_sizes)
    def prefill(self, pick, chunk):
        if not self.engine.prefill(self._pick(Phase.PREFILLING, pick).rid, chunk * self.scale):
            event("pool full at prefill")

    @precondition(_has(Phase.RUNNING))
    @rule(picks=decode_picks)
    def decode(self, picks):
        live = self.engine.live(Phase.RUNNING)
        rids = list(dict.fromkeys(live[p % len(live)].rid for p in picks))
        if len(self.engine.decode(rids)) < len(rids):
            event("pool full at decode")

    @precondition(lambda self: _supports("speculative")(self) and _has(Phase.RUNNING)(self))
    @rule(pick=picks, draft=draft_lengths, accepted=accepted_drafts)
    def decode_speculative(self, pick, draft, accepted):
        """MTP / EAGLE: draft tokens get KV slots, rejected ones are released after verify."""
        if not self.engine.decode_speculative(self._pick(Phase.RUNNING, pick).rid, draft, accepted):
            event("pool full at speculative decode")

    @precondition(lambda self: _tree_drafts(self) and _has(Phase.RUNNING)(self))
    @rule(pick=picks, depth=draft_lengths, accepted=accepted_drafts)
    def decode_speculative_tree(self, pick, depth, accepted):
        """EAGLE tree / NGRAM verify: two drafts a level, the accepted path's KV moved to the window's front."""
        if not self.engine.decode_speculative(self._pick(Phase.RUNNING, pick).rid, 2 * depth, accepted, tree=True):
            event("pool full at speculative decode")

    @precondition(lambda self: _supports("retract")(self) and _has(Phase.RUNNING)(self))
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

    @precondition(lambda self: bool(self._mid_prefill()))
    @rule(pick=picks)
    def abort_prefill(self, pick):
        """Abort a request between two chunks of its prefill: its row ends wherever the last chunk
        did, mid-page as often as not, and all of it must go back."""
        mid = self._mid_prefill()
        self.engine.abort(mid[pick % len(mid)].rid)

    def _mid_prefill(self):
        return [r for r in self.engine.live(Phase.PREFILLING) if r.kv.kv_committed_len > 0]

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

    @precondition(lambda self: bool(self.engine.flushable()))
    @rule(pick=picks)
    def flush(self, pick):
        """An idle node flushes its cache (``flush_cache``, as after a weight update) and serves on."""
        nodes = self.engine.flushable()
        self.engine.flush(nodes[pick % len(nodes)])

    @invariant()
    def pools_agree_with_reference(self):
        if type(self).observer is not None:
            type(self).observer.step_ran(self.engine)
        self.engine.check()
        for label in sorted(self.engine.events):
            event(label)
        self.peak_pressure = max(self.peak_pressure, self.engine.pressure())

    def teardown(self):
        # Hypothesis tears down in a ``finally``: a step that failed is the exception in flight.
        step_failure = sys.exc_info()[1]
        # Steer Hypothesis's targeted phase towards full pools: exhaustion, reuse and failed
        # resumes are where the allocation bugs live.
        _target(self.peak_pressure, "peak pool pressure")
        engine = getattr(self, "engine", None)
        if engine is None:  # the engine could not be built: nothing ran, nothing to check
            log = type(self).decline_log
            if log is not None and log.last is not None and type(self).observer is not None:
                type(self).observer.example_declined(None, log.last)  # every draw of it was one the family declines
            return
        start = len(engine.log)
        known = False
        try:
            if not engine.broken:  # a step failed: its report stands, nothing more to check
                engine.sweep()
                engine.drain()
        except Exception as exc:
            if self._report(engine, exc, engine.log[:start], in_teardown=True):
                known = True
            else:
                raise
        finally:
            if type(self).observer is not None:
                type(self).observer.example_ended(engine)
            engine.close()
        if engine.broken and isinstance(step_failure, Exception):
            steps = list(engine.log)
            pending = engine.pending_step(step_failure)
            if pending is not None:  # the failing operation never recorded itself
                steps.append(pending)
            known = self._report(engine, step_failure, steps, in_teardown=False)
        if known and (step_failure is None or isinstance(step_failure, Exception)):
            # Raised while the failure is in flight, this replaces it: Hypothesis sees an invalid
            # example, not a failure, and steers away from it. (A StopTest or an interrupt in flight
            # ends the example anyway: Hypothesis has concluded its data, and it must go on up.)
            reject()

    def _report(self, engine: Engine, exc: BaseException, steps, *, in_teardown: bool) -> bool:
        """Tell the observer; True if it knows the bug already."""
        if type(self).observer is None:
            return False
        return bool(type(self).observer.example_failed(engine, exc, tuple(steps), in_teardown))


@precondition(lambda self: bool(self.engine.finished))
@rule(pick=picks, extra=extra_tokens)
def _next_turn(self, pick, extra):
    """A chat's next turn: a finished request's tokens continue in a new request (a prefix hit)."""
    done = sorted(self.engine.finished)
    if self.engine.next_turn(done[pick % len(done)], extra) is None:
        event("pool full at next turn")


def _drawn_warm_start(strategy: st.SearchStrategy[ModelConfig]):
    @initialize(config=strategy, prompts=warm_prompts)
    def warm_start(self, config, prompts):
        """Draw the config, build the engine on it, then warm start as :meth:`PoolMachine.warm_start`.

        One rule does both: Hypothesis runs initialize rules in an order of its choosing."""
        self.engine = self._build(config, drawn=True)
        self._warm(prompts)

    return warm_start


def machine_identity(config, faults=(), backup_mode: str | None = None, family_factory=None,
                     options: EngineOptions | None = None) -> bytes:
    """What a failing example's database key is derived from: the machine it fails on.

    The backup mode is the built-in family's resolution of the config and faults (a pure function
    of the blueprint, no pools are built), so ``poolfuzz run`` and a test that names the mode
    explicitly share one key, and keys recorded before this module existed still match.
    """
    mode = backup_mode
    if not isinstance(config, ModelConfig):  # drawn configs: one key for the whole strategy
        mode = mode or "drawn"
    elif mode is None:
        try:
            mode = resolved_backup_mode(config, faults)
        except ConfigError:  # an impossible combination: the engine reports it when the machine runs
            mode = "default"
    name = config.name if isinstance(config, ModelConfig) else DRAWN_NAME
    parts = [f"config={name}", f"faults={','.join(sorted(faults))}", f"backup={mode}"]
    if family_factory is not None and family_factory is not build_family:
        module, name = getattr(family_factory, "__module__", ""), getattr(family_factory, "__qualname__", "")
        parts.append(f"family={module}.{name}")
    # What the machine does, not which failures a run passes over: examples found while passing
    # over known bugs are filed where a plain run of the machine looks for them.
    behaviour = None if options is None else dataclasses.replace(options, waive=(), known=())
    if behaviour is not None and behaviour != EngineOptions():
        parts.append(f"options={behaviour!r}")
    return ("poolfuzz-machine/1 " + " ".join(parts)).encode()


def machine_for(config: ModelConfig | str | st.SearchStrategy, *, device="cpu", faults=(), backup_mode: str | None = None,
                options: EngineOptions = EngineOptions(), family_factory=None,
                observer: MachineObserver | None = None) -> type[PoolMachine]:
    """A PoolMachine subclass bound to one config, device, fault set, backup mode and family.

    ``config`` may be a strategy (or ``"random"``: :func:`~poolfuzz.strategies.drawn_configs` of the
    faults): each example then draws its own config in ``warm_start``.

    Its examples are filed in Hypothesis's database under a key of their own, the same for
    ``poolfuzz run`` and a plain test of it; ``observer`` is told what each example does.
    """
    attrs = dict(device=device, faults=tuple(faults), backup_mode=backup_mode, options=options,
                 observer=observer)
    if isinstance(config, str) and config == DRAWN_NAME:
        # Drawn from the space the family accepts: its storage kinds steered to, the rest filtered; an example
        # whose draw the filter still refuses is counted as declined, with the family's reason.
        caps = factory_capabilities(family_factory)
        log = attrs["decline_log"] = DeclineLog(caps.unsupported_reason) if caps.unsupported_reason else None
        config = drawn_configs(faults=faults, where=None if log is None else log.accepts, shape=caps.model_shaped)
    elif isinstance(config, str):
        config = get_config(config)
    if isinstance(config, ModelConfig):
        attrs["config"] = config
    else:  # a strategy: each example draws its config
        attrs.update(config_strategy=config, warm_start=_drawn_warm_start(config))
    if family_factory is not None:
        attrs["family_factory"] = staticmethod(family_factory)
    # Only a factory that declares it gets the rule: another rule would change what every seed draws.
    if factory_capabilities(family_factory).supports_next_turn:
        attrs["next_turn"] = _next_turn
    cls = type("PoolMachine", (PoolMachine,), attrs)
    set_database_identity(cls, machine_identity(config, faults, backup_mode, family_factory, options))
    return cls
