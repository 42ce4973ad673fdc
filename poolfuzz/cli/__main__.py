"""``python -m poolfuzz.cli``: the same command line as the ``poolfuzz`` script."""

import sys

from poolfuzz.cli import main

code = main()
# CPython (3.8+) marks a KeyboardInterrupt that escapes code run from a string (``exec(str)``,
# dataclass and namedtuple methods) as unhandled, even once caught, and a ``-m`` run whose flag is
# still set at exit kills itself with SIGINT, whatever status it chose: a SIGTERM that landed in
# such code made a stopped run exit -2 instead of 143 (CI, test_sigterm_behaves_like_ctrl_c). The
# next string exec clears the flag; the status the run decided is the one it exits with.
exec("pass")
sys.exit(code)
