"""What pickling torch's ``memory_format`` values costs the controller (issue 25 item 1; ``protocol/torch_values.py``).

Every ``clone()`` and every backward pass sends a ``torch.preserve_format`` in its message batch. Without a reducer,
pickle names such a value by searching ``sys.modules`` for a module that holds it (``whichmodule``: the value has no
``__module__``), module by module; with the ``copyreg`` reducer dask_monarch registers, it pickles as
``pkgutil.resolve_name("torch.preserve_format")``. The baseline, measured in the same run: the same ``pickle.dumps``
with the reducer taken out of ``copyreg``'s table again.

Usage: ``python bench/torch_values.py [--number N]``; no cluster starts. It prints microseconds per ``pickle.dumps``
of ``[torch.preserve_format, torch.contiguous_format]`` both ways and their ratio.
"""

from __future__ import annotations

import argparse
import copyreg
import pickle
import sys
import timeit

import torch

import dask_monarch  # noqa: F401  (registers the reducers: dask_monarch.protocol.torch_values)
from dask_monarch.protocol import torch_values


def per_call(values: list, number: int) -> float:
    return min(timeit.repeat(lambda: pickle.dumps(values, protocol=5), number=number, repeat=5)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="pickle.dumps calls per timing (best of 5)")
    args = parser.parse_args()
    values = [torch.preserve_format, torch.contiguous_format]
    by_reducer = per_call(values, args.number)
    reducers = {kind: copyreg.dispatch_table.pop(kind) for kind in torch_values.TYPES}
    try:
        by_search = per_call(values, args.number)
    finally:
        copyreg.dispatch_table.update(reducers)
    print(f"{len(sys.modules)} modules loaded; pickle.dumps of [preserve_format, contiguous_format]: "
          f"searching sys.modules {by_search * 1e6:.1f} us, copyreg reducer {by_reducer * 1e6:.1f} us, "
          f"ratio {by_search / by_reducer:.1f}")


if __name__ == "__main__":
    main()
