"""SGLang #35957 is found, named and shrunk to a short program that pastes back and reproduces."""

import pytest

from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.machine import machine_for
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS

FAULT = "swa-ignores-mamba-backup"
BUDGET = 200  # examples, derandomized: the faulty and the correct family get the same

# The shrunk program for swa-ssm (derandomized run). Three rules: a warm start admits and prefills
# two requests, SGLang's victim is retracted with its recurrent state left behind by
# SWAKVPool.get_cpu_copy, and it resumes onto a fresh slot.
PINNED_PROGRAM = """\
state = PoolMachine()
state.warm_start(prompts=[1, 1])
state.pools_agree_with_reference()
state.retract_sglang_order()
state.pools_agree_with_reference()
state.resume()
state.pools_agree_with_reference()
state.teardown()"""

# The same failure as engine operations (what ``replay`` and ``emit-test`` work from).
PINNED_STEPS = [
    "admit(prompt_len=1)  # Req(1) row 1 mamba slot 1",
    "prefill(rid=1, chunk=1)  # positions 0..1",
    "admit(prompt_len=1)  # Req(2) row 2 mamba slot 2",
    "prefill(rid=2, chunk=1)  # positions 0..1",
    "retract(rid=2)  # backup RetractionBackup(cpu_tensor, tokens=1, mamba_cpu=no)",
    "resume(node='prefill')  # Req(2) row 3 mamba slot 3",
]


def _rule_steps(program: str) -> list[str]:
    return [line for line in program.splitlines()
            if line.startswith("state.") and not line.startswith(("state.pools_agree", "state.teardown"))]


@pytest.fixture(scope="module")
def found():
    return run_machine(CONFIGS["swa-ssm"], faults=[FAULT], max_examples=BUDGET)


class Test35957:
    def test_fault_is_caught_as_state_lost_on_the_mamba_component(self, found):
        """The resumed request's recurrent state is reported lost, naming the mamba component."""
        assert not found.passed
        assert found.failure.startswith("StateLost: req 2 resumed; component mamba.")
        assert found.divergence["kind"] == "state-lost"
        assert found.divergence["component"].startswith("mamba.")
        assert found.divergence["op"] == "resume"

    def test_shrunk_program_is_short_and_pinned(self, found):
        """The shrunk program is the three-rule story, printed with no tensor dumps."""
        assert found.program == PINNED_PROGRAM
        assert len(_rule_steps(found.program)) <= 10
        assert "tensor(" not in found.program

    def test_shrunk_engine_program_is_the_human_minimal_story(self, found):
        """As engine operations: two requests served, one retracted without its state, resumed."""
        assert [repr(step) for step in found.engine_steps] == PINNED_STEPS

    def test_printed_program_pastes_back_and_reproduces(self, found):
        """Executing the printed program against the faulty machine raises the same StateLost."""
        namespace = {"PoolMachine": machine_for("swa-ssm", faults=[FAULT])}
        with pytest.raises(StateLost, match=r"req 2 resumed; component mamba\."):
            exec(found.program, namespace)

    def test_the_same_program_passes_on_the_correct_family(self, found):
        """Without the fault the program runs clean: the bug, not the program, is what fails."""
        exec(found.program, {"PoolMachine": machine_for("swa-ssm")})

    @pytest.mark.parametrize("config", ["swa-ssm", "swa-ssm-ps4"])
    def test_caught_on_every_config_it_applies_to(self, config):
        """Paged and unpaged SWA+SSM families both lose the state under the fault."""
        result = run_machine(CONFIGS[config], faults=[FAULT], max_examples=BUDGET)
        assert result.divergence is not None and result.divergence["component"].startswith("mamba.")

    @pytest.mark.parametrize("config", ["swa-ssm", "swa-ssm-ps4"])
    def test_correct_family_passes_the_same_budget(self, config):
        """The correct family passes where the faulty one fails."""
        assert run_machine(CONFIGS[config], max_examples=BUDGET).passed
