"""Engine programs several tests replay: SGLang #35957 in its shortest form."""

FAULT_35957 = "swa-ignores-mamba-backup"
# The recurrent state is not backed up at retraction, and the resume reads a new slot.
PROGRAM_35957 = [
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
]
