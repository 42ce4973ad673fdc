"""A built sglang family for a named config, or the test skipped with the reason the release gives."""

import pytest

from poolfuzz.pools.config import CONFIGS


def family_or_skip(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_family(CONFIGS[name])


def release(api):
    """The installed release as a comparable version (the anchored tests pin each release's verdict)."""
    from packaging.version import Version

    return Version(api.version)


def session_driver_or_skip(scheduling, name):
    """A scheduler-path driver of the named config whose server keeps streaming sessions, or the test skipped (the
    release's server refuses the config, with its reason, or keeps no sessions)."""
    from poolfuzz.errors import ConfigError

    try:
        driver = scheduling.SglangSchedulerDriver(CONFIGS[name])
    except ConfigError as exc:
        pytest.skip(str(exc))
    if not driver.streaming_sessions:
        pytest.skip("the scheduler path drives streaming sessions on releases with one global ServerArgs and "
                    "--enable-streaming-session (0.5.10 to 0.5.15)")
    return driver


def dsa_move_is_page_aware(api) -> bool:
    """Whether the release's DSA index cache moves a token's keys inside its page (0.5.23), or indexes the
    page-major buffer by token location (0.5.18: a tree verify's move lands on the wrong page or out of range;
    the page-aware rewrite was proposed as sglang#31060 / #31218)."""
    import torch

    from poolfuzz.adapters.sglang import build_family

    fam = build_family(CONFIGS["dsa-ps64"])
    pool = fam.sg_kv_pool
    buf = pool.index_k_with_scale_buffer[0]
    buf[1].fill_(7)  # page 1, every token
    try:
        pool.move_kv_cache(torch.tensor([64]), torch.tensor([65]))  # token 65 (page 1) onto token 64 (page 1)
    except IndexError:
        return False
    return bool((buf[1] == 7).all())


def served_pressed_continued(e, *, before_next_turn=None) -> int:
    """A 20-token chat served and finished (written through to the host where the tree has one), a
    40-token request that needs the device slots (the chat's nodes are demoted), then the chat's next
    turn, which finds its prefix below the device and loads it back; every step checked. Returns the
    next turn's rid. ``before_next_turn()`` runs between the pressure and the next turn."""
    first = e.admit(20)
    e.check()
    e.prefill(first, 20)
    e.check()
    e.decode([first])
    e.check()
    e.finish(first)
    e.check()
    big = e.admit(40)
    e.check()
    e.prefill(big, 40)
    e.check()
    e.finish(big)
    e.check()
    if before_next_turn is not None:
        before_next_turn()
    turn = e.next_turn(first, 3)
    e.check()
    e.prefill(turn, 8)
    e.check()
    e.decode([turn])
    e.check()
    return turn


def casts_fp8_twice(api) -> bool:
    """A real SGLang defect (0.5.18 to 0.5.21; fixed in 0.5.22 by sglang#40785, which moved the branch): off
    CUDA, ``set_kv_buffer_prefix_valid`` first views fp8 rows as their store dtype (bytes) and then hands them
    to ``set_kv_buffer``, which casts those bytes to fp8 again as numbers: every committed row is garbage."""
    import torch

    from poolfuzz.adapters.sglang.api import construct
    from poolfuzz.adapters.sglang.pools.writes import RadixAttentionFields

    if getattr(api.MHATokenToKVPool, "set_kv_buffer_prefix_valid", None) is None:
        return False  # a release before the door: nothing casts
    pool = construct(api.MHATokenToKVPool, size=4, page_size=1, dtype=torch.float8_e4m3fn, head_num=1, head_dim=8,
                     layer_num=1, device="cpu", enable_memory_saver=False)
    rows = torch.arange(1, 9, dtype=torch.float32).reshape(1, 1, 8).to(torch.float8_e4m3fn)
    pool.set_kv_buffer_prefix_valid(RadixAttentionFields(0), torch.tensor([[2]]), torch.tensor([1]), rows, rows.clone())
    return not torch.equal(pool.k_buffer[0][2].view(torch.uint8), rows[0].view(torch.uint8))
