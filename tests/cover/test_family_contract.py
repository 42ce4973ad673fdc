"""One contract over every pool family the harness drives: the built-in one on every config, a
small test-only family, and (in tests/sglang) SGLang's, as Trio's test_sync runs one contract over
every lock. A family that breaks it is refused with a message naming what is missing."""

import pytest
from minimal_family import MinimalFamily, build_minimal_family

from poolfuzz.harness.contract import ContractViolation, check_family
from poolfuzz.harness.engine import Engine
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import PoolFamily, build_family
from poolfuzz.pools.interface import PoolFamilyInterface

FAMILIES = [pytest.param(build_family, name, id=f"builtin-{name}") for name in CONFIGS]
FAMILIES += [pytest.param(build_minimal_family, name, id=f"minimal-{name}")
             for name in CONFIGS if build_minimal_family.unsupported_reason(CONFIGS[name]) is None]


@pytest.mark.parametrize(("factory", "config"), FAMILIES)
def test_every_family_keeps_the_contract(factory, config):
    check_family(factory, CONFIGS[config])


@pytest.mark.parametrize("family_cls", [PoolFamily, MinimalFamily])
def test_family_classes_are_structural_instances(family_cls):
    family = build_family(CONFIGS["dense"]) if family_cls is PoolFamily else build_minimal_family(CONFIGS["dense"])
    assert isinstance(family, PoolFamilyInterface)


def test_the_test_family_is_fuzzed_like_any_other():
    """The state machine skips fork and transfer for it and finds nothing wrong."""
    result = run_machine(CONFIGS["dense"], family_factory=build_minimal_family, max_examples=20, seed=3)
    assert result.passed, result.failure
    assert result.backup_mode == "cpu_tensor" and result.steps > 20


def test_the_factory_is_called_once_per_node():
    calls = []

    def counting(config, **kwargs):
        calls.append(kwargs)
        return build_family(config, **kwargs)

    Engine(config=CONFIGS["dense"], family_factory=counting)
    assert calls == [dict(device="cpu", faults=(), backup_mode=None)] * 2


class _NoListener(MinimalFamily):
    def set_free_listener(self, listener):
        pass  # frees go unreported: the harness could not poison freed slots


class _Lies(MinimalFamily):
    def has_recurrent_state(self):
        return True


def _factory(cls):
    return lambda config, *, device="cpu", faults=(), backup_mode=None: cls(config, device)


@pytest.mark.parametrize(("cls", "problem"), [
    (_NoListener, "freeing a request's rows was not reported to the free listener"),
    (_Lies, "has_recurrent_state() is True but the components say False"),
])
def test_a_family_that_breaks_the_contract_is_named(cls, problem):
    with pytest.raises(ContractViolation, match=problem.replace("(", r"\(").replace(")", r"\)")):
        check_family(_factory(cls), CONFIGS["dense"])


def test_a_missing_member_is_named():
    class NoProtocol:
        def __init__(self, config, device):
            self.inner = MinimalFamily(config, device)

        def __getattr__(self, name):
            if name == "protocol":
                raise AttributeError(name)
            return getattr(self.inner, name)

    with pytest.raises(ContractViolation, match="family lacks protocol"):
        check_family(_factory(NoProtocol), CONFIGS["dense"])


def test_a_factory_that_raises_is_a_violation_not_a_crash():
    def broken(config, **kwargs):
        raise RuntimeError("no GPU here")

    with pytest.raises(ContractViolation, match="building the family of 'dense' raised RuntimeError: no GPU here"):
        check_family(broken, CONFIGS["dense"])


def test_a_wrong_capability_declaration_is_named():
    family = build_minimal_family(CONFIGS["dense"])

    class Undeclared(type(family.kv_pool)):
        cpu_copy_carries_mamba = "no"

    def factory(config, **kwargs):
        fam = build_minimal_family(config, **kwargs)
        fam.kv_pool.__class__ = Undeclared
        return fam

    with pytest.raises(ContractViolation, match="cpu_copy_carries_mamba as a bool"):
        check_family(factory, CONFIGS["dense"])
