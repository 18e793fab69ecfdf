"""Run a bench script under the memory allocator setting of ``make pipeline``.

The Makefile exports ``GLIBC_TUNABLES`` for every stage (glibc keeps freed blocks up to 1 GiB in the process instead
of returning them to the kernel), and the stages' speed depends on it: a step that allocates large tensors pays a
page fault per 4 KB page whenever glibc gave the memory back (bench/README.md, "Where the time goes"). A bench that
times the stages' work without it measures other costs than the pipeline has: under glibc's default, the RL
updates' full-vocabulary log-softmax took twice the chunked cross-entropy; under the pipeline's setting the two take
the same time. glibc reads the variable when a process starts, so the script starts itself again with it.
"""

from __future__ import annotations

import os
import sys

# the same value as the Makefile's ``pipeline`` target
MALLOC = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296"


def run_under_pipeline_malloc() -> None:
    """Start this script again with ``GLIBC_TUNABLES`` set as ``make pipeline`` sets it, unless it is set already
    (a caller's own setting is kept) or the system's C library is not glibc's (nothing to set)."""
    if "GLIBC_TUNABLES" not in os.environ and sys.platform.startswith("linux"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": MALLOC})
