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
* sgl-project/sglang#31765 (0.5.11 to 0.5.18; not in 0.5.23): a queued session turn its client aborts leaves the
  session marked in flight, so closing the session is deferred for ever and its KV and row are never released.
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


@pytest.mark.anchored
def test_a_session_whose_queued_turn_was_aborted_is_released_when_its_client_closes_it(scheduling, api):
    """sglang#31765 (0.5.11 to 0.5.18; 0.5.23 releases it): a session's second turn is queued (``Session.create_req``
    marks the session ``_inflight``), its client aborts it while it waits, and ``abort_request`` pops it from the
    waiting queue without telling the session; the client closes the session, and the close is deferred for ever
    (``close_on_finish``, a turn in flight that no longer exists). The session's 12 tokens of KV and its row stay
    held: a 40-token request on the 48-token pool is never admitted, and the report names the held session (its own
    signature, ``stuck:session``), and its client cannot open the session again (the server refuses the id it still
    holds). Found by the HiCache server on 0.5.12 and 0.5.15 (mla, hybrid-extra-buffer-ps4, minimax-sparse-konly),
    shrunk to one session by hand. 0.5.10 has no in-flight mark: the session closes."""
    from packaging.version import Version

    from poolfuzz.pools.errors import ServerStuck

    driver = _sessions(scheduling, "dense")
    driver.session_turn(session=0, length=11, max_tokens=1)
    driver.step()
    driver.step()
    queued = driver.session_turn(session=0, length=1, max_tokens=1)
    driver.abort(queued)
    driver.step()
    driver.session_clients.close("session-0", give_up=True)
    driver.step()
    assert driver.outcome[queued] == "aborted"
    driver.add_request(length=40, share=0, max_tokens=2)
    if _release(api) < Version("0.5.11"):
        assert driver.session_clients.held_after_close() == []
        assert driver.drain() is None
        return
    assert driver.session_clients.held_after_close() == ["session-0"]
    # the client cannot open the session again: the server refuses the id it still holds, and nothing is sent
    again = driver.session_turn(session=0, length=1, max_tokens=1)
    assert driver.outcome[again] == "refused" and again not in driver.requests
    with pytest.raises(ServerStuck, match=r"the server still holds session\(s\) session-0, closed by their clients") \
            as stuck:
        driver.drain()
    assert stuck.value.held == "session"


@pytest.mark.anchored
def test_a_mamba_session_whose_queued_turn_was_aborted_is_released_when_its_client_closes_it(scheduling, api):
    """sglang#31765's second variant (0.5.11 to 0.5.18; open PR #31767): on a mamba model a queued session turn that
    admission already tried carries the session's restored row and mamba slot, so ``abort_request`` releases it
    through ``cache_finished_req``, which, seeing no abort reason, commits the never-run turn as the session's last.
    The client's close then waits for that turn for ever, and the session's KV, row and state stay held: a 38-token
    request never gets in. Shrunk by a helper from the HiCache server's mla-ssm run on 0.5.12 to this program (the
    same on the plain server, and on 0.5.14 and 0.5.15)."""
    from packaging.version import Version

    from poolfuzz.pools.errors import ServerStuck

    if _release(api) < Version("0.5.11"):
        pytest.skip("0.5.10 keeps no in-flight mark, and loses a closed session's mamba slots instead (sglang#23496, "
                    "test_admission_reopens_once_closed_sessions_give_back_their_rows)")
    driver = _sessions(scheduling, "mla-ssm")
    driver.session_turn(session=1, length=13, max_tokens=1)
    driver.step()
    driver.step()
    driver.add_request(length=20, share=0, max_tokens=8)
    driver.step()
    queued = driver.session_turn(session=1, length=20, max_tokens=1)
    driver.step()  # admission tries the turn, and restores the session's slot onto it
    assert queued in driver.live() and driver.requests[queued] in driver.server.waiting_queue
    driver.abort(queued)
    driver.add_request(length=38, share=0, max_tokens=1)
    with pytest.raises(ServerStuck, match=r"the server still holds session\(s\) session-1, closed by their clients") \
            as stuck:
        driver.drain()
    assert stuck.value.held == "session"


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
