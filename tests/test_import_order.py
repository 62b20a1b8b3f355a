"""A program that imports dask before torch (issue 25 item 1): torch's own values (``torch.preserve_format``, a
qscheme, ...) still pickle by their torch names, so the workers can load every batch, recording and answer
(``protocol/torch_values.py``). Importing dask imports multiprocessing, whose ``__mp_main__`` alias of the
program's ``__main__`` then sits ahead of ``torch`` in ``sys.modules``, where pickle looks for a value without
``__module__``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from test_scripts import EXAMPLE, EXPECTED, assert_quiet, run_script

# a program's first lines as many are written: dask first; the names pickle looks up are globals of __main__
PICKLES = """
import dask, distributed, pickle, sys
import cloudpickle
import torch
from torch import per_tensor_affine
import dask_monarch
from dask_monarch.protocol import tensor_bytes

assert list(sys.modules).index("__mp_main__") < list(sys.modules).index("torch")
values = [torch.preserve_format, torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
          per_tensor_affine, torch.per_channel_symmetric, torch.strided, torch.sparse_coo, torch.bfloat16,
          torch.device("cpu")]
blobs = {name: dumps(values) for name, dumps in
         (("pickle", pickle.dumps), ("cloudpickle", cloudpickle.dumps), ("answers", tensor_bytes.dumps))}
sys.stdout.buffer.write(pickle.dumps(blobs))
"""

# another process, as a worker is: its __main__ is not the program, and it has not imported dask_monarch
LOADS = """
import pickle, sys
import torch
blobs = pickle.loads(sys.stdin.buffer.read())
for name, blob in blobs.items():
    print(name, pickle.loads(blob))
"""


def test_torch_values_pickled_after_import_dask_load_in_another_process():
    """Plain pickle (the controller's batches), cloudpickle (arguments, remote functions) and the workers' answer
    pickler all name torch: the values load, the same, in a process without the program's ``__main__`` and without
    dask_monarch."""
    made = subprocess.run([sys.executable, "-c", PICKLES], capture_output=True, timeout=120)
    assert made.returncode == 0, made.stderr.decode()[-3000:]
    loaded = subprocess.run([sys.executable, "-c", LOADS], input=made.stdout, capture_output=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr.decode()[-3000:]
    expected = ("[torch.preserve_format, torch.contiguous_format, torch.channels_last, torch.channels_last_3d, "
                "torch.per_tensor_affine, torch.per_channel_symmetric, torch.strided, torch.sparse_coo, "
                "torch.bfloat16, device(type='cpu')]")
    assert loaded.stdout.decode().splitlines() == [f"{name} {expected}" for name in ("pickle", "cloudpickle", "answers")]


def test_a_program_that_imports_dask_first_trains_compiles_and_fetches(tmp_path):
    """The README's example with ``import dask`` and ``import distributed`` before torch, on the embedded cluster:
    backward (its ``clone``s carry ``torch.preserve_format``), a compiled step (the recording carries it too) and
    fetches give the promised values, and nothing error-looking is printed."""
    compiled = """
        @dm.compile
        def step(xb):                        # a compiled step: the recording carries the clones too
            model.zero_grad()
            F.mse_loss(model(xb), torch.zeros(2)).backward()
            return model.weight.grad.clone(memory_format=torch.preserve_format)

        compiled = [step(x) for _ in range(3)]
        model.zero_grad()
        F.mse_loss(model(x), torch.zeros(2)).backward()
        eager = model.weight.grad.clone(memory_format=torch.contiguous_format)
"""
    compared = '    print(step.recordings, torch.equal(dm.inspect(compiled[-1], dp=1), dm.inspect(eager, dp=1)))\n'
    total = '        total = x.reduce("dp", "sum")\n'
    fetch = '    print(dm.fetch_shard(x, dp=1).result())\n'
    example = EXAMPLE.format(cluster="")
    assert total in example and fetch in example
    script = "import dask\nimport distributed\n" + example.replace(
        total, total + textwrap.indent(textwrap.dedent(compiled), " " * 8)).replace(fetch, fetch + compared)
    proc = run_script(tmp_path, script)
    lines = proc.stdout.splitlines()
    assert lines[:2] == EXPECTED
    assert lines[2] == "2 True", proc.stdout  # the recording and its verifying second one; the replay's gradient
    assert_quiet(proc)
