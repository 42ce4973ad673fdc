"""The scheduler path on the bugs it finds in SGLang's own scheduling code (issue 31): each test is one shrunk program,
run on the installed release, with the verdict that release must give.

* sgl-project/sglang#26941 (fixed in 0.5.13): a streaming session's first turn aborted mid-decode keeps its mamba
  slots (the session slot is saved without them): after the session closes, the strict idle check finds them leaked.
* sgl-project/sglang#29352 (0.5.12 to 0.5.14, fixed in 0.5.15): ``SWARadixCache._insert_helper`` revives a tombstoned node by
  freeing its full KV even while a running request holds it (``full_lock_ref > 0``); the slot is handed out again
  and the request decodes on another request's KV.
* SGLang 0.5.15 (0.5.18's code is the same; 0.5.23 refuses the combination; no report found): closing a streaming
  session of an all-SWA model frees its out-of-window slots a second time (``StreamingSession.release_session``
  starts at ``cache_protected_len``, not at the window's eviction frontier).
* sgl-project/sglang#22518 (fixed by 0.5.23): once the running batch is marked full, only a request leaving it clears
  the flag; where the batch empties first (the rows were held by streaming sessions), admission stays shut.
"""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from tests.sglang.families import release as _release
from tests.sglang.families import session_driver_or_skip as _sessions


@pytest.mark.anchored
def test_an_aborted_first_session_turn_gives_back_its_mamba_slots(scheduling, api):
    """sglang#26941: the first turn of a streaming session on an extra-buffer model is aborted while it decodes; the
    client closes the session. 0.5.12 leaks the turn's working slot and its ping-pong track slot; 0.5.13 frees them.
    0.5.10 leaks them too (its idle check words it ``token_to_kv_pool_allocator memory leak detected!``)."""
    from packaging.version import Version

    driver = _sessions(scheduling, "hybrid-extra-buffer")
    rid = driver.session_turn(session=0, length=12, max_tokens=8)
    for _ in range(3):
        driver.step()
    assert driver.requests[rid].output_ids, "the turn is decoding when it is aborted"
    driver.abort(rid)
    with pytest.raises(AssertionError) if _release(api) < Version("0.5.13") else _no_raise() as failure:
        problem = driver.drain()
        assert problem is None, problem
    if failure is not None:
        message = str(failure.value)
        assert ("pool memory leak detected!" in message and "[mamba]" in message) or message.startswith(
            "token_to_kv_pool_allocator memory leak detected!"), message
        assert "leaked_mamba_pages={" in message, message  # SGLang's own page-level diagnosis names the slots
        assert f"session-0 (closed; turns: req {rid} aborted)" in message, message


@pytest.mark.anchored
def test_a_tombstone_revived_under_a_running_request_keeps_its_full_kv(scheduling, api):
    """sglang#29352 (0.5.12 to 0.5.14; 0.5.15 passes), as the fuzzer shrank it on 0.5.12: request 4 (23 tokens, chunked at 16) is prefilled and waits
    to decode; request 7 shares its first 12 tokens, and when its chunk is cached the tree revives the tombstoned
    node request 4 holds by freeing the node's full slots. Request 7's next chunk is handed slot 1, request 4's
    position 0, and request 4's decode reads request 7's KV there."""
    from packaging.version import Version

    from poolfuzz.pools.errors import LostKv

    driver = scheduling.SglangSchedulerDriver(CONFIGS["swa"])
    for length, share in ((7, 0), (1, 0), (1, 2)):
        driver.abort(driver.add_request(length=length, share=share, max_tokens=1))
    victim = driver.add_request(length=22, share=1, max_tokens=2)
    driver.step()
    driver.step()
    driver.add_request(length=14, share=2, max_tokens=1)
    driver.step()
    driver.step()
    driver.add_request(length=1, share=0, max_tokens=1)
    thief = driver.add_request(length=7, share=3, max_tokens=1)
    release = _release(api)
    if release <= Version("0.5.14"):
        with pytest.raises(LostKv) as lost:
            for _ in range(3):
                driver.step()
        assert str(lost.value).startswith(f"req {victim} step 7: full.k layer 0 position 0: block 1 slot 1 holds "
                                          f"req {thief}'s position 18 (another prefix)"), lost.value
    else:  # fixed in 0.5.15 (run on 0.5.14, 0.5.15, 0.5.18 and 0.5.23)
        for _ in range(3):
            driver.step()
        assert driver.drain() is None


@pytest.mark.anchored
def test_admission_reopens_once_closed_sessions_give_back_their_rows(scheduling, api):
    """sglang#22518 on 0.5.13: two sessions' turns finish; a request sharing a prefix waits while the sessions hold
    the rows, which marks the empty running batch full; the sessions close and free everything, and the request
    still waits. The report says why it waits. On 0.5.10 closing the sessions leaks their mamba slots instead
    (``SessionAwareCache.release_session`` frees a session's KV and row, not its state: the leak sglang#23496
    describes; 0.5.12 passes this far): the strict idle check names them."""
    from packaging.version import Version

    from poolfuzz.pools.errors import ServerStuck

    driver = _sessions(scheduling, "hybrid-linear")
    driver.session_turn(session=1, length=1, max_tokens=1)
    driver.session_turn(session=0, length=23, max_tokens=1)
    driver.step()
    driver.step()
    driver.add_request(length=11, share=1, max_tokens=8)
    driver.step()
    if _release(api) < Version("0.5.11"):
        with pytest.raises(AssertionError) as leak:
            driver.drain()
        assert "leaked_mamba_pages={" in str(leak.value) and "session-0 (closed" in str(leak.value), leak.value
    elif _release(api) < Version("0.5.23"):
        with pytest.raises(ServerStuck, match="the running batch is empty but marked full, so the scheduler admits "
                                              "nothing"):
            driver.drain()
    else:
        assert driver.drain() is None


class _no_raise:
    """``pytest.raises``' counterpart for the fixed release: the block must finish; ``as`` binds None."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.anchored
def test_closing_a_session_of_an_all_swa_model_frees_its_out_of_window_slots_twice(scheduling, api):
    """0.5.15 (the first release with all-SWA pools; judged by replay and by instrumenting the allocator): a session
    of a model whose every layer is sliding-window decodes past its window, so ``maybe_evict_swa`` frees the
    out-of-window slot (``free_swa_out_of_window_slots``); closing the session, ``StreamingSession.release_session``
    frees ``req_to_token[row, protected:allocated]`` from ``cache_protected_len``, not from the slot's
    ``swa_evicted_seqlen``, so that slot is freed again. A hybrid SWA allocator skips it (its full-to-SWA mapping
    was zeroed); the all-SWA allocator has one pool and no mapping, and its own guard trips (with other requests
    live, the slot would sit twice in the free list). 0.5.18's ``release_session`` is the same; 0.5.23 refuses
    ``--enable-streaming-session`` for an all-SWA model."""
    import traceback

    driver = _sessions(scheduling, "swa-only")
    driver.session_turn(session=0, length=1, max_tokens=1)
    driver.step()
    driver.session_turn(session=0, length=1, max_tokens=6)
    with pytest.raises(AssertionError) as freed:
        driver.drain()
    frames = [frame.name for frame in traceback.extract_tb(freed.value.__traceback__)]
    assert "release_session" in frames and frames[-1] == "free", frames
