"""``--config random`` on SGLang's own servers: drawn models over the installed SGLang's scheduler and pools.

The installed release decides what can be built: a server it refuses is declined (the example is rejected), never
reported as a failure.
"""

import re

from poolfuzz.strategies import drawn_configs


def _without_a_known_defect(c) -> bool:
    """Not a kind with a judged defect of the release, each listed and written up: K-only MiniMax layers crash at
    retraction (sglang#32603); FP4 pools (MHA and MLA) lose their scale rows at retraction and PD transfer
    (ci/known/sglang-0.5.23.txt, docs/bugs/sglang-mha-fp4-scales.md and sglang-mla-fp4-scales.md); a ``page_head``
    HiCache host pool with fewer pages than layers dies at startup (0.5.13 on:
    docs/bugs/sglang-hicache-page-head-views.md, a drawn config of this test found it again)."""
    return "K" not in c.msa_layers and c.kv_quant != "fp4_mx_block16" and not _page_head_short_of_pages(c)


def _page_head_short_of_pages(c) -> bool:
    """Whether ``c``'s HiCache tier is ``page_head`` with more than one layer: a HiCache tree sizes its
    host pool from a device capacity of a few pages (32 tokens for a drawn 240-token pool of 16-token pages: 3 host
    pages for 4 layers), so any such config can have fewer host pages than layers. An over-approximation."""
    from poolfuzz.adapters.sglang.host_tier.hicache import host_tier

    return host_tier(c)[0] == "page_head" and c.num_layers > 1


def test_drawn_models_run_through_sglangs_own_scheduler(scheduling):
    """``--family sglang:scheduler --config random``: each example draws a model (its layers, storage, pages and, for
    a long context, prompts of thousands of tokens) and starts a server on it; what SGLang refuses at startup is
    declined, what it builds is fuzzed through its own Scheduler and passes, but for sglang#39271 and the parked SWA
    chunk (below)."""
    import re

    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from poolfuzz.adapters.sglang import build_scheduler_driver, scheduler_unsupported_reason
    from poolfuzz.harness.scheduled import scheduled_machine
    from tests.judged import PassOverJudged

    class PassOverClippedPrompts(PassOverJudged):
        """sglang#39271 (anchored in test_sglang_scheduling.py), as SGLang itself reports it: on a pool a prompt can
        fill, the server accepts the prompt with max_new_tokens clipped to 0 and PrefillAdder never admits it. A
        stuck server whose every listed request is one of those ("0 of 0 tokens out") is passed over, and so are the
        judged sliding-window defects below; any other stuck request, or any other failure, fails. (A draw of a
        1-token pool found it again.)"""

        def __init__(self):
            super().__init__("sglang", "none", "random")
            self.declined: list[str] = []

        def example_declined(self, config, reason):
            self.declined.append(reason)

        def example_failed(self, machine, exc, program, in_teardown) -> bool:
            listed = re.findall(r"with (\d+) of (\d+) tokens out", str(exc))
            clipped = "still unfinished" in str(exc) and listed and all(want == "0" for _, want in listed)
            # A sliding-window server whose SWA pool holds at most two windows and a page, stuck on SWA its waiting
            # or chunked request pins itself: a chunk PrefillAdder parks on its budget's page of headroom while the
            # window lock holds the request's own out-of-window node, or a request whose locked prefix hit takes the
            # SWA its admission check then finds short (two judged engine defects, docs/bugs/sglang-swa-parked-chunk.md,
            # each tested in test_sglang_scheduling.py; draws of 3- and 4-token window pools found them)
            # (the second form stalls wherever the SWA pool is no larger than a chunk, a window and a page: a draw of
            # a 36-token pool beside 64-token chunks found it at stop 67)
            c = machine.driver.config
            chunk = machine.driver.server_args.get("chunked_prefill_size") or 0
            states = re.findall(r"req \d+ ([a-z-]+ ?\(?[a-z]*\)?) with", str(exc))
            parked = ("still unfinished" in str(exc) and c.has_swa and states
                      and c.swa_tokens <= max(chunk, c.sliding_window) + c.sliding_window + c.page_size
                      and set(states) <= {"mid-prefill (chunked)", "waiting"})
            # A sliding-window server that cuts two requests' chunks in one pass commits a middle chunk's token to
            # the first (docs/bugs/sglang-swa-two-chunked-requests.md, tested in test_sglang_scheduling.py): SGLang
            # holds the tokens given and more
            held = re.match(r"req \d+ step \d+: SGLang holds tokens \[([\d, ]*)\], but it was given \[([\d, ]*)\]",
                            str(exc))
            doubled = bool(held and c.has_swa and held.group(1).startswith(held.group(2) + ", "))
            self.passed_over += bool(clipped or parked or doubled)
            return bool(clipped or parked or doubled)

    drivers, judged = [], PassOverClippedPrompts()

    def factory(config):
        drivers.append(build_scheduler_driver(config))
        return drivers[-1]

    machine = scheduled_machine(drawn_configs(where=_without_a_known_defect), driver_factory=factory, observer=judged,
                                decline=scheduler_unsupported_reason)
    run_state_machine_as_test(machine, settings=settings(max_examples=25, stateful_step_count=30, deadline=None,
                                                         derandomize=True, database=None,
                                                         suppress_health_check=list(HealthCheck)))
    assert len(drivers) > 5 and judged.declined
    # The servers answered traffic, not only started: more requests than servers. (A fixed count, "> 50", failed or
    # passed with unrelated edits of the package, 45 to 143: Hypothesis draws the literals of its modules, so the
    # drawn programs move with them.)
    answered = sum(len(d.outcome) for d in drivers)
    assert answered > len(drivers), (answered, len(drivers))
