"""Contents derived from tokens alone: a chained hash of a request's token ids, and the K/V/state tags of it.

An engine's own scheduler decides which blocks or slots a request's positions land in, and a prefix hit
shares another request's; so what a slot must hold is a function of the tokens up to its position, never of
who computed it. Both engines' worker stand-ins (``adapters/vllm/worker.py``, ``adapters/sglang/scheduler/runner.py``)
write and check these values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MASK = (1 << 63) - 1
_PRIME = 0x100000001B3
COMPONENTS = ("k", "v")  # tag component indices 0 and 1; a recurrent state is len(COMPONENTS)


def chain_after(chain: int, token: int, position: int) -> int:
    """The chained hash of a request's tokens through ``position``: what its KV there derives from."""
    return ((chain ^ (token + (position << 32))) * _PRIME) & MASK


def tag(chain: int, layer: int, component: int) -> int:
    """The value a K or V slot holds for a position (its chain), salted by layer and component (below 256, so no
    two (layer, component) pairs share a salt)."""
    return ((chain * 31 + (layer << 8) + component + 1) * _PRIME) & MASK


def sampled_token(chain: int, vocab: int) -> int:
    """The token the stand-in model samples after a sequence: determined by the sequence alone. Taken from the
    chain's high bits: the next chain XORs the token into the low ones, so a token of the low bits would zero them,
    and every later sample would be the same token."""
    return (chain >> SAMPLE_SHIFT) % vocab


def drafts_right(chain: int, count: int) -> int:
    """How many of a drafter's ``count`` tokens after a sequence are the ones the model samples (0 to ``count``):
    determined by the sequence alone (``draft_choices``)."""
    return draft_choices(chain) % (count + 1)


def draft_choices(chain: int, salt: int = 0) -> int:
    """Bits a drafter draws its choices from after a sequence, one draw per ``salt`` (a draft tree's node): determined
    by the sequence alone, every bit mixed (splitmix64's finaliser), so draws for neighbouring salts are unrelated
    (the chain's own hash leaves them correlated in the high bits)."""
    x = (chain ^ (salt * 0x9E3779B97F4A7C15)) & _WORD
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _WORD
    return x ^ (x >> 31)


_WORD = (1 << 64) - 1
SAMPLE_SHIFT = 32


@dataclass(kw_only=True)
class Tokens:
    """What the harness knows of a request: every token id (prompt, then samples) and their chains."""

    ids: list[int]
    chains: list[int] = field(default_factory=list)

    def chain(self, position: int) -> int:
        while len(self.chains) <= position:
            p = len(self.chains)
            self.chains.append(chain_after(self.chains[-1] if self.chains else 0, self.ids[p], p))
        return self.chains[position]
