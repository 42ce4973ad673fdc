"""ReferenceFamily agrees with the real family on free capacity and on which operation exhausts which pool."""

import pytest

from poolfuzz.pools import CONFIGS, PoolExhausted, build_family
from poolfuzz.pools.family import resolved_backup_mode
from poolfuzz.pools.reference import ReferenceFamily
from poolfuzz.pools.request import ReqKv

# host_pool wherever the family can take it (no recurrent state, and KV a host pool mirrors)
# The script's big request is 41 tokens: a config whose context is shorter (hybrid-spec-long) has no row for it.
SCRIPT_TOKENS = 41
CASES = [pytest.param(name, mode, id=f"{name}-{mode}") for name in CONFIGS if CONFIGS[name].max_context >= SCRIPT_TOKENS
         for mode in ["cpu_tensor"] + (["host_pool"] if resolved_backup_mode(CONFIGS[name]) == "host_pool" else [])]

# A fixed program: two long requests, a retraction, a big request that may not fit, a resume
# that may have to wait, then small admissions until rows or mamba slots run out.
SCRIPT = [
    ("admit", 1, 23), ("extend", 1, 22), ("evict", 1, 22),
    ("admit", 2, 15), ("extend", 2, 8), ("evict", 2, 8), ("extend", 2, 14), ("evict", 2, 14),
    ("retract", 1),
    ("admit", 3, 41), ("extend", 3, 40),
    ("resume", 1),
    ("finish", 3),
    ("resume", 1),
    ("retract", 2), ("discard", 2),
    ("admit", 4, 3), ("extend", 4, 2),
    ("admit", 5, 3), ("extend", 5, 2),
    ("admit", 6, 3), ("admit", 7, 3), ("admit", 8, 3),
    ("finish", 4), ("finish", 5), ("finish", 1),
    ("admit", 9, 3), ("extend", 9, 2), ("retract", 9), ("resume", 9), ("finish", 9),
]


class Pair:
    """Drives one real family and its reference model through the same operations."""

    def __init__(self, name: str, mode: str):
        self.family = build_family(CONFIGS[name], device="cpu", backup_mode=mode)
        self.ref = ReferenceFamily(CONFIGS[name], backup_mode=mode)
        self.reqs: dict[int, ReqKv] = {}

    def real(self, op, rid, arg):
        f, p = self.family, self.family.protocol
        req = self.reqs.get(rid)
        if op == "admit":
            req = self.reqs[rid] = ReqKv(rid=rid, seqlen=arg)
            p.admit(req, f)
        elif op == "extend":
            p.extend(req, f, arg)
            req.kv_committed_len = arg
        elif op == "evict":
            p.evict_swa(req, f, pre_len=arg)
        elif op == "retract":
            p.retract(req, f)
        elif op == "resume":
            p.resume(req, f)
        elif op == "finish":
            p.release_kv(req, f)
        elif op == "discard":
            p.discard(req, f)

    def model(self, op, rid, arg):
        r = self.ref
        if op == "admit":
            r.admit(rid).seqlen = arg
        elif op == "extend":
            r.extend(rid, arg)
        elif op == "evict":
            r.evict_swa(rid, arg)
        elif op == "retract":
            r.retract(rid)
        elif op == "resume":
            r.resume(rid)
        elif op == "finish":
            r.finish(rid)
        elif op == "discard":
            r.discard(rid)

    def available(self) -> tuple[dict[str, int], dict[str, int]]:
        real = {space: a.available_size() for space, a in self.family.free_lists().items()}
        return real, {space: self.ref.available(space) for space in real}

    def skip(self, op, rid) -> bool:
        """Operations that make no sense after an earlier step was refused (both sides must agree)."""
        req = self.reqs.get(rid)
        ref_req = self.ref.requests.get(rid)
        if op == "admit":
            return False
        if req is None or (req.req_pool_idx is None and req.retraction_backup is None):
            assert ref_req is None or not ref_req.holds_row and ref_req.backup_tokens is None
            return True
        if op == "resume":
            assert (req.retraction_backup is None) == (ref_req.backup_tokens is None)
            return req.retraction_backup is None
        if op == "evict":
            return not self.family.config.has_swa
        if op in ("retract", "finish", "extend"):
            return req.req_pool_idx is None
        return False


def run_script(name: str, mode: str) -> list[tuple[int, str, int, int]]:
    """Run SCRIPT on both sides, comparing after every step; returns the exhaustions seen."""
    pair = Pair(name, mode)
    exhausted = []
    for step, (op, rid, *rest) in enumerate(SCRIPT):
        arg = rest[0] if rest else None
        if pair.skip(op, rid):
            continue
        outcome = []
        for side in (pair.real, pair.model):
            try:
                side(op, rid, arg)
                outcome.append(None)
            except PoolExhausted as exc:
                outcome.append((exc.space, exc.requested, exc.available))
        assert outcome[0] == outcome[1], f"step {step} {op}({rid}): real {outcome[0]}, reference {outcome[1]}"
        if outcome[0] is not None:
            exhausted.append((step, *outcome[0]))
        real, ref = pair.available()
        assert real == ref, f"after step {step} {op}({rid})"
        for space in pair.ref.free:
            assert pair.ref.free[space] + pair.ref.held(space) == pair.ref.total(space), space
    return exhausted


class TestReferenceAgreement:
    @pytest.mark.parametrize(("name", "mode"), CASES)
    def test_same_capacity_and_same_exhaustion(self, name, mode):
        """After every scripted step both sides report equal free capacity and raise equal PoolExhausted."""
        exhausted = run_script(name, mode)
        assert exhausted, "the script must exhaust some pool on every config"

    def test_dense_exhaustions_are_pinned(self):
        """dense (48 slots, 5 rows): request 3 cannot get 40 slots, and the sixth admit finds no row."""
        assert run_script("dense", "host_pool") == [
            (10, "full", 40, 34),  # 48 - 14 held by request 2
            (22, "rows", 1, 0),  # requests 1, 4, 5, 6, 7 hold every row
        ]

    def test_swa_ps4_resume_waits_for_full_pages(self):
        """swa-ps4: while request 3 holds 40 positions the resume's 22 positions do not fit."""
        # Full 64 slots: request 2 holds 16, request 3 holds 40 -> 8 free; the resume needs
        # fill_len 22 = 6 pages = 24 slots. The full side is checked before the SWA tail.
        assert run_script("swa-ps4", "host_pool") == [(11, "full", 24, 8), (22, "rows", 1, 0)]

    def test_hybrid_linear_runs_out_of_mamba_slots_before_rows(self):
        """hybrid-linear has 4 mamba slots for 5 rows: the admit that finds no slot names mamba."""
        spaces = [space for _, space, _, _ in run_script("hybrid-linear", "cpu_tensor")]
        assert "mamba" in spaces and "rows" not in spaces

    def test_swa_exhausts_the_swa_side(self):
        """swa (32 SWA slots): request 3's 40 positions exhaust the SWA side, not the full side."""
        assert run_script("swa", "host_pool")[0] == (10, "swa", 40, 26)  # 32 - 6 window slots of request 2

    def test_reference_starts_full(self):
        """A fresh reference reports every space at full capacity, in slots."""
        ref = ReferenceFamily(CONFIGS["swa-ps4"], backup_mode="host_pool")
        assert {s: ref.available(s) for s in ref.free} == {
            "rows": 5, "full": 64, "swa": 64, "host.full": 128, "host.swa": 128}

    def test_reference_host_needs_are_page_padded(self):
        """host_needs pads the backup to pages and covers the SWA window from its page floor."""
        ref = ReferenceFamily(CONFIGS["swa-ps4"], backup_mode="host_pool")
        assert ref.host_needs(22) == {"host.full": 24, "host.swa": 8}  # window 6: [16, 22) -> 2 pages


@pytest.mark.parametrize("tail_only, swa_free", [(True, 64 - 8), (False, 64 - 24)])
def test_a_paged_swa_resume_holds_the_tail_or_every_position_as_the_family_declares(tail_only, swa_free):
    """22 positions, window 6: the tail-only resume holds SWA pages for [16, 22), the other one
    (SGLang before alloc_extend_swa_tail) for all 22 positions, evicting nothing."""
    ref = ReferenceFamily(CONFIGS["swa-ps4"], backup_mode="cpu_tensor", resume_swa_tail_only=tail_only)
    req = ref.pre_alloc(1, 22)
    assert (req.swa_lo, ref.available("swa"), ref.available("full")) == (16 if tail_only else 0, swa_free, 64 - 24)


def test_the_harness_never_writes_into_the_reference():
    """The engine and its checks drive the reference through its operations only: no assignment,
    deletion or pop on anything reached from a reference object."""
    import ast
    from pathlib import Path

    import poolfuzz.harness

    offenders = []
    for path in Path(poolfuzz.harness.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "pop", "append", "extend", "update", "clear", "setdefault"):
                targets = [node.func.value]
            for target in targets:
                if isinstance(target, (ast.Name, ast.Tuple)):
                    continue  # binding a local name is not writing into what it names
                text = ast.unparse(target)
                root = text.split(".")[0].split("[")[0]
                if root.endswith("ref") or "refs[" in text or ".request(" in text:
                    offenders.append(f"{path.name}:{node.lineno}: {text}")
    assert offenders == []
