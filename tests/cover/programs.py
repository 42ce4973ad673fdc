"""Engine programs several tests replay: SGLang #35957 in its shortest form, and a known bug's consequence."""

FAULT_35957 = "swa-ignores-mamba-backup"
# The recurrent state is not backed up at retraction, and the resume reads a new slot.
PROGRAM_35957 = [
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
]

# free_swa keeps full_to_swa (sglang#25805): with the ownership bug known, a retraction under decode
# pressure frees a kept SWA slot a second time. Found by a 3-minute campaign with three planted bugs.
FAULT_KEPT_MAPPING = "free-swa-keeps-mapping"
PROGRAM_KEPT_MAPPING_DOUBLE_FREE = [
    {"op": "admit", "args": {"prompt_len": 5}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 5}},
    {"op": "admit", "args": {"prompt_len": 8}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 8}},
    {"op": "admit", "args": {"prompt_len": 17}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 17}},
    {"op": "decode", "args": {"rids": [1, 2]}},
    {"op": "decode", "args": {"rids": [1]}},
    {"op": "decode", "args": {"rids": [3, 2]}},
    {"op": "decode", "args": {"rids": [2]}},
    {"op": "decode", "args": {"rids": [1, 2]}},
    {"op": "decode", "args": {"rids": [3]}},
    {"op": "decode", "args": {"rids": [3, 2]}},
    {"op": "decode", "args": {"rids": [1]}},
    {"op": "decode", "args": {"rids": [2]}},
    {"op": "decode", "args": {"rids": [1, 2]}},
    {"op": "decode", "args": {"rids": [1, 2]}},
    {"op": "decode", "args": {"rids": [2, 1]}},
]

# Slot 0 handed out (sglang#17404): Req(1) holds the padding slot, another request's speculative
# decode pads into it, and a fork of Req(1) copies the clobbered state. Found by a 3-minute
# campaign run with the slot-zero bug known.
PROGRAM_SLOT_ZERO_FORK = [
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 1}},
    {"op": "decode_speculative", "args": {"rid": 2, "draft": 1, "accepted": 0}},
    {"op": "fork", "args": {"src_rid": 1, "extra": 1}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 1}},
]

# A resume that does not fit keeps the mamba slot it took (mamba-leak-on-abort, sglang#12693), as a
# campaign on hybrid-linear left it: Req(3)'s prompt in two chunks, where one would do.
FAULT_LEAK_ON_ABORT = "mamba-leak-on-abort"
PROGRAM_LEAK_ON_ABORT_CHUNKED = [
    {"op": "admit", "args": {"prompt_len": 16}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 16}},
    {"op": "admit", "args": {"prompt_len": 17}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 13}},
    {"op": "admit", "args": {"prompt_len": 19}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 13}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 7}},
    {"op": "decode", "args": {"rids": [1]}},
]

# The same leak seen late: Req(3)'s failed resumes leak a mamba slot each (free-count:mamba at
# step 7), and the second resume then runs out of mamba slots where the reference expects KV to.
PROGRAM_LEAK_THEN_OUTCOME = [
    {"op": "admit", "args": {"prompt_len": 8}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 8}},
    {"op": "admit", "args": {"prompt_len": 20}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 20}},
    {"op": "admit", "args": {"prompt_len": 20}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 20}},
    {"op": "decode", "args": {"rids": [1]}},
    {"op": "resume", "args": {"node": "prefill"}},
    {"op": "resume", "args": {"node": "prefill"}},
]

# A recycled mamba slot handed out without the clear a fresh request needs (mamba-not-cleared,
# sglang#10400), as a campaign on hybrid-linear left it: Req(1) retracted and resumed three times
# only to move the free list along until slot 1 comes back for Req(2).
FAULT_NOT_CLEARED = "mamba-not-cleared"
PROGRAM_NOT_CLEARED_CYCLED = [
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 1}},
]

# The same leak as a hunt's seed 0 left it: Req(1), one token, only fills the KV pool a little more,
# which a longer Req(2) does as well (a request folded into another's prompt: two steps fewer).
PROGRAM_LEAK_EXTRA_REQUEST = [
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
    {"op": "admit", "args": {"prompt_len": 16}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 16}},
    {"op": "admit", "args": {"prompt_len": 20}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 20}},
    {"op": "admit", "args": {"prompt_len": 12}},
    {"op": "retract", "args": {"rid": 3}},
    {"op": "prefill", "args": {"rid": 4, "chunk": 12}},
    {"op": "resume", "args": {"node": "prefill"}},
]

# The same leak with the KV pool filled by decodes of a request whose prompt is already the longest
# the machine draws (a hunt's seed 2): their tokens can only go to another request's prompt.
PROGRAM_LEAK_DECODED_AT_BOUND = [
    {"op": "admit", "args": {"prompt_len": 11}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 11}},
    {"op": "admit", "args": {"prompt_len": 20}},
    {"op": "prefill", "args": {"rid": 2, "chunk": 20}},
    {"op": "admit", "args": {"prompt_len": 8}},
    {"op": "prefill", "args": {"rid": 3, "chunk": 8}},
    {"op": "decode", "args": {"rids": [2]}},
    {"op": "decode_speculative", "args": {"rid": 2, "draft": 3, "accepted": 2}},
    {"op": "decode", "args": {"rids": [2, 1]}},
    {"op": "decode_speculative", "args": {"rid": 2, "draft": 1, "accepted": 1}},
    {"op": "decode", "args": {"rids": [3, 2]}},
]
