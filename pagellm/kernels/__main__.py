"""`python -m pagellm.kernels`: build the CPU kernels now rather than at the first start."""

import sys

from pagellm.kernels import cpu_kernels_available

if __name__ == "__main__":
    available = cpu_kernels_available()
    print("pagellm CPU kernels:", "ready" if available else "unavailable (torch ops are used)")
    sys.exit(0)
