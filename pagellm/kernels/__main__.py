"""`python -m pagellm.kernels [--require]`: build the CPU kernels now rather than at the first
start, those only some configurations call included. Without them the engine runs torch ops
instead; `--require` makes that an error (exit status 1), for test set-ups where the kernels'
tests would otherwise be skipped."""

import sys

from pagellm.kernels import (cpu_kernels_available, int8_other_forms_available,
                             on_demand_kernels_available)

if __name__ == "__main__":
    available = (cpu_kernels_available() and on_demand_kernels_available()
                 and int8_other_forms_available())
    print("pagellm CPU kernels:", "ready" if available else "unavailable (torch ops are used)")
    sys.exit(1 if "--require" in sys.argv[1:] and not available else 0)
