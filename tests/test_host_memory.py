"""large_blocks_mapped (tetrad/models/host_memory.py): inside it a large host tensor gets a
mapping of its own, so freeing it returns its pages, where glibc's own rule (after a large block
has been freed) puts it in the heap; on leaving, glibc's own ceilings apply again. Checked in a
fresh process: a process that has run other tests has free heap space, which glibc hands out
before it maps or extends anything."""

import subprocess
import sys

import pytest

from tetrad.models.host_memory import _mallopt

pytestmark = pytest.mark.skipif(_mallopt() is None, reason="not glibc")

CHECK = """
from pathlib import Path
import torch
from tetrad.models.host_memory import large_blocks_mapped

BLOCK = 8 << 20

def in_heap(tensor):
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            start, end = (int(value, 16) for value in line.split()[0].split("-"))
            return start <= tensor.data_ptr() < end
    return False

torch.empty(2 * BLOCK, dtype=torch.uint8).fill_(1)  # freed: glibc's threshold rises to 16 MiB
outside = torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
with large_blocks_mapped():
    inside = torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
after = torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
print(in_heap(outside), in_heap(inside), in_heap(after))
"""


def test_large_blocks_are_mapped_inside_and_heap_blocks_after():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                            check=True)
    outside, inside, after = result.stdout.split()
    assert (outside, inside, after) == ("True", "False", "True")
